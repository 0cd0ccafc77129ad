"""oscar's INT2 KV cache as a vLLM attention backend (docs/VLLM.md).

``plugin.register`` is the ``vllm.general_plugins`` entry point; ``backend`` holds the vLLM classes (imported only
inside vLLM). ``spec``, ``layout`` and ``core`` need no vLLM: KV-cache sizes, metadata -> kernel arguments,
artifact -> per-layer tensors, and the attention step itself in torch + ``oscar_kernels.ops``.
"""
