"""A load_inline candidate: `fastelbo compile` maps compiler errors back to lines of this file.

The tests never build it (no GPU in CI); they write the files load_inline would generate.
"""
cuda_src = """
__global__ void scale_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}

__global__ void shift_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + undefined_offset;
}
"""

cpp_src = """
torch::Tensor scale(torch::Tensor x);
torch::Tensor shift(torch::Tensor x) { return x + missing_symbol; }
"""


class ModelNew:
    pass
