// Inference batch norm folded into the convolution before it (fusekit.ops.norm.fold_batchnorm);
// dtype preludes with suffixes _w, _b, _p, _o define the storage types.
extern "C" __global__ void fold_batchnorm(
    const T_w* w, const T_b* b, const T_p* gamma, const T_p* beta, const T_p* mean, const T_p* var, float eps,
    long long per, long long n, int has_b, int affine, T_o* w_out, T_o* b_out) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x) {
        long long k = i / per;  // the output channel: the outermost dim of KCRS and KRSC alike
        float s = rsqrtf(ld_p(var, k) + eps);
        if (affine) s = ld_p(gamma, k) * s;
        st_o(w_out, i, ld_w(w, i) * s);
        if (i == k * per) {
            float shift = ((has_b ? ld_b(b, k) : 0.0f) - ld_p(mean, k)) * s;
            if (affine) shift += ld_p(beta, k);
            st_o(b_out, k, shift);
        }
    }
}
