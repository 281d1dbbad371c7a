"""Fast target passes without forking the model: what the CPU has, and the kernels that use it.

    cpu          the host CPU's model name and instruction-set flags (AVX2, AVX-512, AMX)
    device       device parsing and the synchronisation every timing needs on an accelerator
    packing      packed linear layers (oneDNN, panel, blocks) and the bf16 choice
    kernels      the compiled fp32 panel GEMM (``csrc/panel_gemm.cpp``) for small-row passes
    attention    tree attention on grouped KV heads without copying them
    kvcache      HF's DynamicCache with layers that append in place (targets and feature heads)
    quant        4-bit linear layers for drafters (PyTorch's CPU int4 kernel), never for targets

Nothing here imports the rest of treespec.
"""
