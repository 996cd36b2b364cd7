"""The GPU engine: the batching executor, the backends (our Triton kernels on cuda, the torch
reference on cpu), the one launch path, and the registry of shared-memory regions. It owns
CUDA; front ends reach it through ``attention_service.link.EngineLink``."""
