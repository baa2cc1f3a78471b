// Pooling and softmax kernels (fusekit.ops.pool); a dtype prelude (dtype_*.cuh) defines T, ld and st.
#define GRID_LOOP(i, total) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (total); \
         i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// Element i of an (N, C, H, W) walk in memory order: c fastest when channels-last, else w.
__device__ __forceinline__ void decode(long long i, int C, int H, int W, int cl, int& n, int& c, int& h, int& w) {
    if (cl) { c = (int)(i % C); i /= C; w = (int)(i % W); i /= W; h = (int)(i % H); n = (int)(i / H); }
    else    { w = (int)(i % W); i /= W; h = (int)(i % H); i /= H; c = (int)(i % C); n = (int)(i / C); }
}

// A window's taps along one axis: from its first tap inside the input (s), d apart, below e.
__device__ __forceinline__ void taps(int o, int st, int p, int k, int d, int size, int& s, int& e) {
    s = o * st - p;
    e = imin(s + (k - 1) * d + 1, size);
    if (s < 0) s += ((-s + d - 1) / d) * d;
}

// One thread per output; padding never wins; ties keep the first window position; NaN wins.
extern "C" __global__ void max_pool_fwd(
    const T* x, T* y, int* am, long long total, int C, int H, int W, int Ho, int Wo,
    int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw,
    long long xn, long long xc, long long xh, long long xw,
    long long yn, long long yc, long long yh, long long yw, int cl, int want_idx) {
    GRID_LOOP(i, total) {
        int n, c, ho, wo, hs, he, ws, we;
        decode(i, C, Ho, Wo, cl, n, c, ho, wo);
        taps(ho, sh, ph, kh, dh, H, hs, he);
        taps(wo, sw, pw, kw, dw, W, ws, we);
        const T* xp = x + (n * xn + c * xc);
        float best = neg_inf();
        int arg = hs * W + ws;
        for (int h = hs; h < he; h += dh) {
            for (int w = ws; w < we; w += dw) {
                const float v = ld(xp, h * xh + w * xw);
                if (v > best || v != v) { best = v; arg = h * W + w; }
            }
        }
        const long long o = n * yn + c * yc + ho * yh + wo * yw;
        st(y, o, best);
        if (want_idx) am[o] = arg;
    }
}

// Inference max pooling of dense channels-last x into dense channels-last y, no argmax: one thread
// per (n, ho, wo, 16-byte channel group), 16-byte loads and stores, 32-bit index math (the host
// checks that N*Ho*Wo*C/VEC fits an int and that C is a multiple of VEC). Same values as
// max_pool_fwd: padding never wins, NaN wins.
#define VEC (16 / (int)sizeof(T))
union Pack { uint4 u; T e[VEC]; };

// Thread i of a channels-last walk in 16-byte channel groups: (group g, column q, row ho, image n), the
// group fastest; q counts output columns, or tiles of them.
__device__ __forceinline__ void decode_vec(int i, int groups, int Q, int Ho, int& g, int& q, int& ho, int& n) {
    g = i % groups;
    int t = i / groups;
    q = t % Q; t /= Q;
    ho = t % Ho;
    n = t / Ho;
}

extern "C" __global__ void max_pool_fwd_nhwc_vec(
    const T* x, T* y, int total, int C, int H, int W, int Ho, int Wo, int kh, int kw, int sh, int sw, int ph, int pw,
    int dh, int dw) {
    const int groups = C / VEC;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        int g, wo, ho, n;
        decode_vec(i, groups, Wo, Ho, g, wo, ho, n);
        int hs, he, ws, we;
        taps(ho, sh, ph, kh, dh, H, hs, he);
        taps(wo, sw, pw, kw, dw, W, ws, we);
        float best[VEC];
        #pragma unroll
        for (int j = 0; j < VEC; ++j) best[j] = neg_inf();
        const T* xn = x + (long long)n * H * W * C + g * VEC;
        for (int h = hs; h < he; h += dh) {
            for (int w = ws; w < we; w += dw) {
                Pack v;
                v.u = *reinterpret_cast<const uint4*>(xn + ((long long)h * W + w) * C);
                #pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float f = ld(v.e, j);
                    if (f > best[j] || f != f) best[j] = f;
                }
            }
        }
        Pack o;
        #pragma unroll
        for (int j = 0; j < VEC; ++j) st(o.e, j, best[j]);
        *reinterpret_cast<uint4*>(y + (((long long)n * Ho + ho) * Wo + wo) * C + g * VEC) = o.u;
    }
}

// One thread per dy element: atomicAdd of dy into acc (float32, zeroed) at its argmax.
template <typename I>
__device__ __forceinline__ void max_pool_bwd(
    const T* dy, const I* am, float* acc, long long total, int C, int Ho, int Wo, int H, int W,
    long long dn, long long dc, long long dh, long long dw,
    long long an, long long ac, long long ah, long long aw,
    long long gn, long long gc, long long gh, long long gw, int cl) {
    GRID_LOOP(i, total) {
        int n, c, ho, wo;
        decode(i, C, Ho, Wo, cl, n, c, ho, wo);
        const long long a = (long long)am[n * an + c * ac + ho * ah + wo * aw];
        if (a < 0 || a >= (long long)H * W) continue;  // not an index into the plane: dropped
        const int h = (int)(a / W), w = (int)(a % W);
        atomicAdd(acc + (n * gn + c * gc + h * gh + w * gw), ld(dy, n * dn + c * dc + ho * dh + wo * dw));
    }
}

#define MAX_POOL_BWD(NAME, I) \
extern "C" __global__ void NAME( \
    const T* dy, const I* am, float* acc, long long total, int C, int Ho, int Wo, int H, int W, \
    long long dn, long long dc, long long dh, long long dw, \
    long long an, long long ac, long long ah, long long aw, \
    long long gn, long long gc, long long gh, long long gw, int cl) { \
    max_pool_bwd<I>(dy, am, acc, total, C, Ho, Wo, H, W, dn, dc, dh, dw, an, ac, ah, aw, gn, gc, gh, gw, cl); \
}
MAX_POOL_BWD(max_pool_bwd_i32, int)
MAX_POOL_BWD(max_pool_bwd_i64, long long)

extern "C" __global__ void cast_f32(const float* a, T* o, long long total) {
    GRID_LOOP(i, total) st(o, i, a[i]);
}

// PyTorch's divisor: the window clipped to the padded input (count_include_pad) or to the input;
// div_override > 0 replaces it (divisor_override).
__device__ __forceinline__ int avg_window(int ho, int wo, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw,
                                          int cip, int div_override, int& hs, int& he, int& ws, int& we) {
    hs = ho * sh - ph; ws = wo * sw - pw;
    he = imin(hs + kh, H + ph); we = imin(ws + kw, W + pw);
    const int padded = (he - hs) * (we - ws);
    hs = imax(hs, 0); ws = imax(ws, 0); he = imin(he, H); we = imin(we, W);
    return div_override > 0 ? div_override : cip ? padded : (he - hs) * (we - ws);
}

extern "C" __global__ void avg_pool_fwd(
    const T* x, T* y, long long total, int C, int H, int W, int Ho, int Wo,
    int kh, int kw, int sh, int sw, int ph, int pw, int cip, int div_override,
    long long xn, long long xc, long long xh, long long xw,
    long long yn, long long yc, long long yh, long long yw, int cl) {
    GRID_LOOP(i, total) {
        int n, c, ho, wo, hs, he, ws, we;
        decode(i, C, Ho, Wo, cl, n, c, ho, wo);
        const int div = avg_window(ho, wo, H, W, kh, kw, sh, sw, ph, pw, cip, div_override, hs, he, ws, we);
        const T* xp = x + (n * xn + c * xc);
        float s = 0.f;
        for (int h = hs; h < he; ++h)
            for (int w = ws; w < we; ++w) s += ld(xp, h * xh + w * xw);
        st(y, n * yn + c * yc + ho * yh + wo * yw, s / (float)div);
    }
}

// One thread per input element, gathering from the windows that cover it (deterministic).
extern "C" __global__ void avg_pool_bwd(
    const T* dy, T* dx, long long total, int C, int H, int W, int Ho, int Wo,
    int kh, int kw, int sh, int sw, int ph, int pw, int cip, int div_override,
    long long dn, long long dc, long long dh, long long dw,
    long long xn, long long xc, long long xh, long long xw, int cl) {
    GRID_LOOP(i, total) {
        int n, c, h, w;
        decode(i, C, H, W, cl, n, c, h, w);
        const int hos = (h + ph < kh) ? 0 : (h + ph - kh) / sh + 1, hoe = imin((h + ph) / sh + 1, Ho);
        const int wos = (w + pw < kw) ? 0 : (w + pw - kw) / sw + 1, woe = imin((w + pw) / sw + 1, Wo);
        const T* dp = dy + (n * dn + c * dc);
        float s = 0.f;
        for (int ho = hos; ho < hoe; ++ho) {
            for (int wo = wos; wo < woe; ++wo) {
                int hs, he, ws, we;
                const int div = avg_window(ho, wo, H, W, kh, kw, sh, sw, ph, pw, cip, div_override, hs, he, ws, we);
                s += ld(dp, ho * dh + wo * dw) / (float)div;
            }
        }
        st(dx, n * xn + c * xc + h * xh + w * xw, s);
    }
}

// Softmax family over rows of length L (axis stride aL/bL/qL); a row's other three indices come
// from r with o2 fastest. mode 0: softmax(a); 1: log_softmax(a); 2: softmax backward (a = y,
// b = dy); 3: log_softmax backward (a = y, b = dy). Output to q.
#define ROW_ARGS \
    const T* a, const T* b, T* q, long long rows, int L, int o1, int o2, \
    long long a0, long long a1, long long a2, long long aL, \
    long long b0, long long b1, long long b2, long long bL, \
    long long q0, long long q1, long long q2, long long qL, int mode

#define ROW_POINTERS(r) \
    const long long i2 = (r) % o2, t_ = (r) / o2, i1 = t_ % o1, i0 = t_ / o1; \
    const T* pa = a + (i0 * a0 + i1 * a1 + i2 * a2); \
    const T* pb = b + (i0 * b0 + i1 * b1 + i2 * b2); \
    T* pq = q + (i0 * q0 + i1 * q1 + i2 * q2);

// One thread per row (rows adjacent in memory go to adjacent threads).
extern "C" __global__ void softmax_rows(ROW_ARGS) {
    GRID_LOOP(r, rows) {
        ROW_POINTERS(r)
        if (mode < 2) {
            float m = neg_inf();
            for (int k = 0; k < L; ++k) m = fmaxf(m, ld(pa, k * aL));
            float s = 0.f;
            for (int k = 0; k < L; ++k) s += expf(ld(pa, k * aL) - m);
            if (mode == 0) {
                const float inv = 1.f / s;
                for (int k = 0; k < L; ++k) st(pq, k * qL, expf(ld(pa, k * aL) - m) * inv);
            } else {
                const float lse = logf(s);
                for (int k = 0; k < L; ++k) st(pq, k * qL, (ld(pa, k * aL) - m) - lse);
            }
        } else {
            float s = 0.f;
            for (int k = 0; k < L; ++k) s += mode == 2 ? ld(pb, k * bL) * ld(pa, k * aL) : ld(pb, k * bL);
            for (int k = 0; k < L; ++k) {
                const float yv = ld(pa, k * aL), g = ld(pb, k * bL);
                st(pq, k * qL, mode == 2 ? yv * (g - s) : g - expf(yv) * s);
            }
        }
    }
}

__device__ __forceinline__ float warp_max(float v) {
    for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

// One warp per row, lanes striding along it (for rows contiguous in memory). blockDim % 32 == 0.
extern "C" __global__ void softmax_rows_warp(ROW_ARGS) {
    const int lane = threadIdx.x & 31;
    const long long warps = blockDim.x >> 5;
    for (long long r = (long long)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += warps * gridDim.x) {
        ROW_POINTERS(r)
        if (mode < 2) {
            float m = neg_inf();
            for (int k = lane; k < L; k += 32) m = fmaxf(m, ld(pa, k * aL));
            m = warp_max(m);
            float s = 0.f;
            for (int k = lane; k < L; k += 32) s += expf(ld(pa, k * aL) - m);
            s = warp_sum(s);
            if (mode == 0) {
                const float inv = 1.f / s;
                for (int k = lane; k < L; k += 32) st(pq, k * qL, expf(ld(pa, k * aL) - m) * inv);
            } else {
                const float lse = logf(s);
                for (int k = lane; k < L; k += 32) st(pq, k * qL, (ld(pa, k * aL) - m) - lse);
            }
        } else {
            float s = 0.f;
            for (int k = lane; k < L; k += 32) s += mode == 2 ? ld(pb, k * bL) * ld(pa, k * aL) : ld(pb, k * bL);
            s = warp_sum(s);
            for (int k = lane; k < L; k += 32) {
                const float yv = ld(pa, k * aL), g = ld(pb, k * bL);
                st(pq, k * qL, mode == 2 ? yv * (g - s) : g - expf(yv) * s);
            }
        }
    }
}

// LayerNorm over the channels at each position of an (N, C, H, W) image, any strides: one warp per
// position (positions in n, h, w order: adjacent in channels-last memory), lanes striding along the
// channels. Two passes over the row (it stays in L1): the mean, then the variance of the deviations;
// y = (x - mean) * rsqrt(var + eps) * g + b, with g and b float32 (unread where affine is 0).
extern "C" __global__ void layer_norm_channels(
    const T* x, const float* g, const float* b, T* y, long long rows, int C, int H, int W,
    long long xn, long long xc, long long xh, long long xw,
    long long yn, long long yc, long long yh, long long yw, float eps, int affine) {
    const int lane = threadIdx.x & 31;
    const long long warps = blockDim.x >> 5;
    for (long long r = (long long)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += warps * gridDim.x) {
        const long long w = r % W, t_ = r / W, h = t_ % H, n = t_ / H;
        const T* px = x + (n * xn + h * xh + w * xw);
        T* py = y + (n * yn + h * yh + w * yw);
        float s = 0.f;
        for (int k = lane; k < C; k += 32) s += ld(px, k * xc);
        const float mean = warp_sum(s) / C;
        float v = 0.f;
        for (int k = lane; k < C; k += 32) { const float d = ld(px, k * xc) - mean; v += d * d; }
        const float rstd = 1.f / sqrtf(warp_sum(v) / C + eps);
        for (int k = lane; k < C; k += 32) {
            const float z = (ld(px, k * xc) - mean) * rstd;
            st(py, k * yc, affine ? z * g[k] + b[k] : z);
        }
    }
}

// ResNeSt's rSoftMax / SKNet's softmax over paths: x, an (N, card*radix*C, 1, 1) vector laid out as
// (card, radix, C), softmax over the radix, y laid out as (radix, card, C). One thread per (n, k, j).
extern "C" __global__ void radix_softmax(
    const T* x, T* y, long long total, int card, int radix, int C,
    long long xn, long long xc, long long yn, long long yc) {
    GRID_LOOP(i, total) {
        const int j = (int)(i % C);
        const long long t = i / C;
        const int k = (int)(t % card);
        const long long n = t / card;
        const T* px = x + (n * xn + ((long long)k * radix * C + j) * xc);
        const long long step = (long long)C * xc;
        float m = neg_inf();
        for (int r = 0; r < radix; ++r) m = fmaxf(m, ld(px, r * step));
        float s = 0.f;
        for (int r = 0; r < radix; ++r) s += expf(ld(px, r * step) - m);
        T* py = y + (n * yn + ((long long)k * C + j) * yc);
        for (int r = 0; r < radix; ++r) st(py, (long long)r * card * C * yc, expf(ld(px, r * step) - m) / s);
    }
}

// Nearest upsampling by integer factors (sh, sw): output (h, w) is input (h / sh, w / sw), PyTorch's
// "nearest" for those factors. One thread per output element in its memory order; values copied as stored.
extern "C" __global__ void upsample_nearest(
    const T* x, T* y, long long total, int C, int Ho, int Wo, int sh, int sw,
    long long xn, long long xc, long long xh, long long xw,
    long long yn, long long yc, long long yh, long long yw, int cl) {
    GRID_LOOP(i, total) {
        int n, c, h, w;
        decode(i, C, Ho, Wo, cl, n, c, h, w);
        y[n * yn + c * yc + h * yh + w * yw] = x[n * xn + c * xc + (h / sh) * xh + (w / sw) * xw];
    }
}

// ShuffleNet's channel shuffle: output channel k is input channel (k % groups) * (C / groups) + k / groups.
// One thread per output element in its memory order; the values are copied as stored.
extern "C" __global__ void channel_shuffle(
    const T* x, T* y, long long total, int C, int H, int W, int groups,
    long long xn, long long xc, long long xh, long long xw,
    long long yn, long long yc, long long yh, long long yw, int cl) {
    const int per = C / groups;
    GRID_LOOP(i, total) {
        int n, k, h, w;
        decode(i, C, H, W, cl, n, k, h, w);
        const int c = (k % groups) * per + k / groups;
        y[n * yn + k * yc + h * yh + w * yw] = x[n * xn + c * xc + h * xh + w * xw];
    }
}

// The activations of the fused graphs (fusekit.patterns.ACTIVATIONS) by code, as PyTorch defines
// them: 0 identity, 1 relu, 2 clip (alpha: upper bound), 3 silu, 4 gelu (erf), 5 gelu_tanh,
// 6 sigmoid, 7 tanh, 8 hardswish, 9 hardsigmoid, 10 leaky_relu (alpha: slope), 11 elu (alpha). NaN stays NaN.
__device__ __forceinline__ float activate(float v, int act, float alpha) {
    switch (act) {
        case 1: return v < 0.f ? 0.f : v;
        case 2: return v < 0.f ? 0.f : (v > alpha ? alpha : v);
        case 3: return v / (1.f + expf(-v));
        case 4: return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
        case 5: return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
        case 6: return 1.f / (1.f + expf(-v));
        case 7: return tanhf(v);
        case 8: return v * fminf(fmaxf(v + 3.f, 0.f), 6.f) * (1.f / 6.f);
        case 9: return fminf(fmaxf(v * (1.f / 6.f) + 0.5f, 0.f), 1.f);
        case 10: return v > 0.f ? v : alpha * v;
        case 11: return v > 0.f ? v : alpha * expm1f(v);
        default: return v;
    }
}

// Depthwise convolution (one filter per channel, PyTorch's groups = C) + bias + activation: one
// thread per output in y's memory order (channels fastest when y is channels-last, so a warp reads
// 32 channels of one input pixel at once). Filter taps float32 at any strides (wc, wh, ww): a view
// of an (R, S, C) buffer gives a warp 32 adjacent taps. Accumulated in float32.
extern "C" __global__ void depthwise_conv(
    const T* x, const float* w, const float* b, T* y, long long total, int C, int H, int W, int Ho, int Wo,
    int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw,
    long long xn, long long xc, long long xh, long long xw, long long wc, long long wh, long long ww,
    long long yn, long long yc, long long yh, long long yw, int cl, int has_bias, int act, float alpha) {
    GRID_LOOP(i, total) {
        int n, c, ho, wo;
        decode(i, C, Ho, Wo, cl, n, c, ho, wo);
        const int h0 = ho * sh - ph, w0 = wo * sw - pw;
        const T* xp = x + (n * xn + c * xc);
        const float* wp = w + c * wc;
        float acc = has_bias ? b[c] : 0.f;
        for (int r = 0; r < kh; ++r) {
            const int h = h0 + r * dh;
            if (h < 0 || h >= H) continue;
            for (int s = 0; s < kw; ++s) {
                const int col = w0 + s * dw;
                if (col < 0 || col >= W) continue;
                acc = fmaf(ld(xp, h * xh + col * xw), wp[r * wh + s * ww], acc);
            }
        }
        st(y, n * yn + c * yc + ho * yh + wo * yw, activate(acc, act, alpha));
    }
}

// depthwise_conv for dense channels-last x and y and dense (R, S, C) float32 taps: one thread per
// (n, ho, wo, 16-byte channel group), 16-byte loads of x and stores of y, the taps as float4s, 32-bit
// thread index (the host checks N*Ho*Wo*C/VEC fits an int, C a multiple of VEC, every pointer
// 16-byte aligned). Same values as depthwise_conv.
extern "C" __global__ void depthwise_conv_nhwc_vec(
    const T* x, const float* w, const float* b, T* y, int total, int C, int H, int W, int Ho, int Wo,
    int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw, int has_bias, int act, float alpha) {
    const int groups = C / VEC;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        int g, wo, ho, n;
        decode_vec(i, groups, Wo, Ho, g, wo, ho, n);
        const int c0 = g * VEC;
        float acc[VEC];
        #pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = has_bias ? b[c0 + j] : 0.f;
        const T* xn = x + (long long)n * H * W * C + c0;
        const int h0 = ho * sh - ph, w0 = wo * sw - pw;
        for (int r = 0; r < kh; ++r) {
            const int h = h0 + r * dh;
            if (h < 0 || h >= H) continue;
            for (int s = 0; s < kw; ++s) {
                const int col = w0 + s * dw;
                if (col < 0 || col >= W) continue;
                Pack v;
                v.u = *reinterpret_cast<const uint4*>(xn + ((long long)h * W + col) * C);
                const float4* wp = reinterpret_cast<const float4*>(w + ((long long)r * kw + s) * C + c0);
                #pragma unroll
                for (int q = 0; q < VEC / 4; ++q) {
                    const float4 f = wp[q];
                    acc[4 * q + 0] = fmaf(ld(v.e, 4 * q + 0), f.x, acc[4 * q + 0]);
                    acc[4 * q + 1] = fmaf(ld(v.e, 4 * q + 1), f.y, acc[4 * q + 1]);
                    acc[4 * q + 2] = fmaf(ld(v.e, 4 * q + 2), f.z, acc[4 * q + 2]);
                    acc[4 * q + 3] = fmaf(ld(v.e, 4 * q + 3), f.w, acc[4 * q + 3]);
                }
            }
        }
        Pack o;
        #pragma unroll
        for (int j = 0; j < VEC; ++j) st(o.e, j, activate(acc[j], act, alpha));
        *reinterpret_cast<uint4*>(y + (((long long)n * Ho + ho) * Wo + wo) * C + c0) = o.u;
    }
}

// Global average pooling, pass 1: thread i sums the positions split, split + splits, ... of channel c of
// image n (c fastest: a warp reads 32 adjacent channels of one position in channels-last memory) and
// adds its float32 partial sum into sums[n * C + c] (zeroed by the host).
extern "C" __global__ void channel_sums(
    const T* x, float* sums, long long total, int N, int C, int HW, int W, int splits,
    long long xn, long long xc, long long xh, long long xw) {
    GRID_LOOP(i, total) {
        const int c = (int)(i % C);
        const long long t = i / C;
        const int n = (int)(t % N);
        const int split = (int)(t / N);
        const T* xp = x + (n * xn + c * xc);
        float acc = 0.f;
        for (int p = split; p < HW; p += splits) acc += ld(xp, (p / W) * xh + (p % W) * xw);
        atomicAdd(sums + (long long)n * C + c, acc);
    }
}

// Pass 2: y[n, c] = sums[n * C + c] * scale, stored in y's dtype (y: (N, C, 1, 1) at strides yn, yc).
extern "C" __global__ void scaled_store(const float* sums, T* y, long long total, int C, long long yn, long long yc, float scale) {
    GRID_LOOP(i, total) {
        st(y, (i / C) * yn + (i % C) * yc, sums[i] * scale);
    }
}

// depthwise_conv_nhwc_vec for stride 1 and dilation 1 along W and filters at most DW_MAXS wide: each
// thread computes DW_TQ adjacent outputs of its 16-byte channel group, loading each input vector of a
// filter row once into a register window (S + DW_TQ - 1 loads per row instead of S per output).
#define DW_TQ 4
#define DW_MAXS 9
extern "C" __global__ void depthwise_conv_nhwc_tile(
    const T* x, const float* w, const float* b, T* y, int total, int C, int H, int W, int Ho, int Wo,
    int kh, int kw, int sh, int ph, int pw, int dh, int has_bias, int act, float alpha) {
    const int groups = C / VEC;
    const int tiles = (Wo + DW_TQ - 1) / DW_TQ;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        int g, tile, ho, n;
        decode_vec(i, groups, tiles, Ho, g, tile, ho, n);
        const int c0 = g * VEC, wo0 = tile * DW_TQ;
        float acc[DW_TQ][VEC];
        #pragma unroll
        for (int q = 0; q < DW_TQ; ++q) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) acc[q][j] = has_bias ? b[c0 + j] : 0.f;
        }
        const T* xn = x + (long long)n * H * W * C + c0;
        const int h0 = ho * sh - ph, w0 = wo0 - pw;
        for (int r = 0; r < kh; ++r) {
            const int h = h0 + r * dh;
            if (h < 0 || h >= H) continue;
            Pack win[DW_MAXS + DW_TQ - 1];
            #pragma unroll
            for (int j = 0; j < DW_MAXS + DW_TQ - 1; ++j) {
                const int col = w0 + j;
                if (j < kw + DW_TQ - 1 && col >= 0 && col < W) win[j].u = *reinterpret_cast<const uint4*>(xn + ((long long)h * W + col) * C);
                else win[j].u = uint4{0u, 0u, 0u, 0u};
            }
            #pragma unroll
            for (int k = 0; k < DW_MAXS; ++k) {
                if (k >= kw) break;
                float wv[VEC];
                const float4* wp = reinterpret_cast<const float4*>(w + ((long long)r * kw + k) * C + c0);
                #pragma unroll
                for (int q = 0; q < VEC / 4; ++q) {
                    const float4 f = wp[q];
                    wv[4 * q] = f.x; wv[4 * q + 1] = f.y; wv[4 * q + 2] = f.z; wv[4 * q + 3] = f.w;
                }
                #pragma unroll
                for (int q = 0; q < DW_TQ; ++q) {
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[q][j] = fmaf(ld(win[q + k].e, j), wv[j], acc[q][j]);
                }
            }
        }
        #pragma unroll
        for (int q = 0; q < DW_TQ; ++q) {
            if (wo0 + q >= Wo) break;
            Pack o;
            #pragma unroll
            for (int j = 0; j < VEC; ++j) st(o.e, j, activate(acc[q][j], act, alpha));
            *reinterpret_cast<uint4*>(y + (((long long)n * Ho + ho) * Wo + wo0 + q) * C + c0) = o.u;
        }
    }
}

// Per-channel pointwise work on dense images (fusekit.ops.channelwise): y = act(x * g[c] + b[c] + z) with
// g, b float32 (unread where affine is 0: y = act(x + z)) and z an image like x (unread where has_z is
// 0); or, for the gate, y = x * s[n, c] with s (N, C) at strides (sn, sc). One thread per element of
// y's memory order, x and z read through their own strides.
extern "C" __global__ void channel_pointwise(
    const T* x, const float* g, const float* b, const T* z, T* y, long long total, int C, int H, int W, int cl,
    long long xn, long long xc, long long xh, long long xw, long long zn, long long zc, long long zh, long long zw,
    long long yn, long long yc, long long yh, long long yw, int affine, int has_z, int act, float alpha) {
    GRID_LOOP(i, total) {
        int n, c, h, w;
        decode(i, C, H, W, cl, n, c, h, w);
        float v = ld(x, n * xn + c * xc + h * xh + w * xw);
        if (affine) v = fmaf(v, g[c], b[c]);
        if (has_z) v += ld(z, n * zn + c * zc + h * zh + w * zw);
        st(y, n * yn + c * yc + h * yh + w * yw, activate(v, act, alpha));
    }
}

// channel_pointwise for x, z and y all dense channels-last: one thread per 16-byte group of channels
// (C a multiple of VEC, pointers 16-byte aligned, total / VEC an int: the host checks).
extern "C" __global__ void channel_pointwise_nhwc_vec(
    const T* x, const float* g, const float* b, const T* z, T* y, int total, int C, int affine, int has_z, int act, float alpha) {
    const int groups = C / VEC;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        const int c0 = (i % groups) * VEC;
        Pack v, zv, o;
        v.u = reinterpret_cast<const uint4*>(x)[i];
        if (has_z) zv.u = reinterpret_cast<const uint4*>(z)[i];
        #pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float e = ld(v.e, j);
            if (affine) e = fmaf(e, g[c0 + j], b[c0 + j]);
            if (has_z) e += ld(zv.e, j);
            st(o.e, j, activate(e, act, alpha));
        }
        reinterpret_cast<uint4*>(y)[i] = o.u;
    }
}

extern "C" __global__ void channel_gate_mul(
    const T* x, const T* s, T* y, long long total, int C, int H, int W, int cl, long long xn, long long xc, long long xh, long long xw,
    long long sn, long long sc, long long yn, long long yc, long long yh, long long yw) {
    GRID_LOOP(i, total) {
        int n, c, h, w;
        decode(i, C, H, W, cl, n, c, h, w);
        st(y, n * yn + c * yc + h * yh + w * yw, ld(x, n * xn + c * xc + h * xh + w * xw) * ld(s, n * sn + c * sc));
    }
}

// channel_gate_mul for dense channels-last x and y: one thread per 16-byte group of channels, hw the
// positions of an image (the host checks as for channel_pointwise_nhwc_vec).
extern "C" __global__ void channel_gate_nhwc_vec(const T* x, const T* s, T* y, int total, int C, int hw, long long sn, long long sc) {
    const int groups = C / VEC;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        const int c0 = (i % groups) * VEC, n = i / (groups * hw);
        const T* sp = s + n * sn + c0 * sc;
        Pack v, o;
        v.u = reinterpret_cast<const uint4*>(x)[i];
        #pragma unroll
        for (int j = 0; j < VEC; ++j) st(o.e, j, ld(v.e, j) * ld(sp, j * sc));
        reinterpret_cast<uint4*>(y)[i] = o.u;
    }
}
