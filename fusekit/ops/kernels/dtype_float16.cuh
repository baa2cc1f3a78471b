// Storage type for float16: T, ld (load to float32), st (store rounded to nearest even), each name followed by a suffix.
typedef unsigned short T$s;
__device__ __forceinline__ float ld$s(const T$s* p, long long i) {
    float f; unsigned short h = p[i];
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ void st$s(T$s* p, long long i, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i] = h;
}
