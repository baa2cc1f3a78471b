// Storage type for bfloat16: T, ld (load to float32), st (store rounded to nearest even), each name followed by a suffix.
typedef unsigned short T$s;
__device__ __forceinline__ float ld$s(const T$s* p, long long i) { return __uint_as_float(((unsigned int)p[i]) << 16); }
__device__ __forceinline__ void st$s(T$s* p, long long i, float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) p[i] = (unsigned short)((u >> 16) | 0x40u);  // quiet NaN
    else p[i] = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
