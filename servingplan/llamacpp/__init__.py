"""llama.cpp as a second engine (issue 22): its scheduler lives in servingplan.sim.llamacpp_slots; here
the streaming client for llama-server, the GGUF conversion of the seeded model and the build's paths."""
