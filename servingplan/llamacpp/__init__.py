"""Stage llamacpp: reads the seeded model (converted to GGUF) and llama-server; writes
results/llamacpp/{model.gguf,profile,fit,server,validation,engines.json}; run by rules/llamacpp.smk.

llama.cpp as a second engine (issue 22): its scheduler lives in servingplan.simulate.llamacpp_slots; here
the streaming client for llama-server, the GGUF conversion of the seeded model and the build's paths.
"""
