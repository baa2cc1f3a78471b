// Storage type for float32: T, ld (load to float32), st (store rounded to nearest even), each name followed by a suffix.
typedef float T$s;
__device__ __forceinline__ float ld$s(const T$s* p, long long i) { return p[i]; }
__device__ __forceinline__ void st$s(T$s* p, long long i, float v) { p[i] = v; }
