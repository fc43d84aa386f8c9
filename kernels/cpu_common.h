/* What every file of treespec's CPU kernels shares: the headers, the instruction roads, the bf16
 * widening and rounding, the fixed-order lane sums and the eight-lane exponential. The kernels are
 * one translation unit (cpu_kernels.c includes this header and then each file in turn, so the
 * compiler sees them whole and the library stays one build); a file may use what an earlier one
 * defines. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 64

/* What an entry point returns when it could not allocate its work buffers (0: done). It returns
 * before computing anything, and the Python side raises MemoryError. */
#define TREESPEC_NO_MEMORY 1

static inline __m256 widen_bf16(const uint16_t *p) {
    __m128i half = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline float lanes_sum(__m256 v) { /* one fixed order: (0+4, 1+5, 2+6, 3+7), then pairs */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float add_tail(const float *x, const uint16_t *w, int64_t k0, int64_t K, float acc) {
    for (int64_t k = k0; k < K; k++) {
        uint32_t bits = (uint32_t)w[k] << 16;
        float wk;
        memcpy(&wk, &bits, sizeof wk);
        acc = __builtin_fmaf(x[k], wk, acc);
    }
    return acc;
}

/* The instruction roads, slowest first: one per process (treespec_set_isa), since the roads differ
 * in their last bits (each is batch-invariant on its own). The Python side reads this table
 * (treespec_road_*) for the roads' names, codes and the CPU flags each needs. */
enum { ISA_AVX2 = 0, ISA_AVX512_BF16 = 2, ISA_AMX = 3 };
static int g_isa = ISA_AVX2;
static const struct {
    const char *name;
    int code;
    const char *flags; /* /proc/cpuinfo flags, space-separated */
} ROADS[] = {
    {"avx2", ISA_AVX2, "avx2 fma"},
    {"avx512bf16", ISA_AVX512_BF16, "avx2 fma avx512f avx512bw avx512_bf16"},
    {"amx", ISA_AMX, "avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16"},
};
int treespec_road_count(void) { return (int)(sizeof ROADS / sizeof ROADS[0]); }
const char *treespec_road_name(int i) { return ROADS[i].name; }
int treespec_road_code(int i) { return ROADS[i].code; }
const char *treespec_road_flags(int i) { return ROADS[i].flags; }

/* The road this process takes: ISA_AVX2, ISA_AVX512_BF16 or ISA_AMX (the caller has checked the
 * CPU, and for AMX that the OS permits it). */
void treespec_set_isa(int isa) { g_isa = isa; }
int treespec_get_isa(void) { return g_isa; }

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

static inline float widen_one(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t round_bf16(float f) { /* round to nearest even, as PyTorch rounds */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* a quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* round_bf16 on eight lanes: each lane's bf16 bits in the low half of its 32 (the same
 * round-to-nearest-even and quiet NaN as the scalar). */
static inline __m256i round_bf16x8(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40)), nan);
}

/* widen_one(round_bf16(v)) on eight lanes. */
static inline __m256 widen_rounded8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16x8(v), 16)); }

/* exp on eight fp32 lanes: Cody-Waite reduction x = n ln2 + r, a degree-5 polynomial for e^r
 * (Cephes' coefficients, ~1 ulp) and 2^n from the exponent bits, inputs clamped to
 * [-87.3, 88.3]. Every lane runs the same sequence, so a value's exponential does not depend on
 * its neighbours or its position: the attention's weights and SiLU stay batch-invariant, at a
 * fraction of a scalar expf's cost. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* exp8 over n <= 8 values (the tail of a run goes through the same lanes, zero-padded). */
static inline void exp_run(const float *in, float *out, int64_t n) {
    if (n == 8) {
        _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
        return;
    }
    float a[8] = {0}, b[8];
    memcpy(a, in, sizeof(float) * n);
    _mm256_storeu_ps(b, exp8(_mm256_loadu_ps(a)));
    memcpy(out, b, sizeof(float) * n);
}
