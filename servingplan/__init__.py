"""servingplan: size an LLM chat service from measurements and simulation."""
