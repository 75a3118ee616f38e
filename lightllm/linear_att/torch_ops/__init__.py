"""Pure-torch twins of the Triton kernels (the CPU path of `lightllm.linear_att.ops`); call them through ops.py."""
