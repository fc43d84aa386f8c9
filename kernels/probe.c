/* The arithmetic peak of a road, for the kernel micro-benchmark (scripts/bench_cpu_kernels.py):
 * every thread runs twelve independent chains of fp32 FMAs (AVX2: 16 flops each) or of bf16 dot
 * products (AVX512-BF16: 64 flops each) from registers, `iterations` times, or on the AMX road
 * four chains of tile products (16,384 flops each) iterations / 64 times. Returns flops per
 * second over all threads. */
BF16_TARGET static double peak_bf16(int64_t iterations) {
    __m512 acc[12];
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t n = 0; n < iterations; n++)
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    float sink = 0.0f, dots[4];
    for (int i = 0; i < 12; i += 4) {
        sums4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], dots);
        sink += dots[0] + dots[1] + dots[2] + dots[3];
    }
    return sink;
}

AMX_TARGET static double peak_amx(int64_t iterations) { /* four independent accumulator tiles */
    static const uint16_t zeros[16 * 32] = {0};
    float out[256];
    amx_configure();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, zeros, 64);
    _tile_loadd(5, zeros, 64);
    for (int64_t n = 0; n < iterations; n++) {
        _tile_dpbf16ps(0, 5, 4);
        _tile_dpbf16ps(1, 5, 4);
        _tile_dpbf16ps(2, 5, 4);
        _tile_dpbf16ps(3, 5, 4);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}

static double peak_fma(int64_t iterations) {
    __m256 acc[12];
    const __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-8f);
    for (int i = 0; i < 12; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t n = 0; n < iterations; n++)
        for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    float sink = 0.0f;
    for (int i = 0; i < 12; i++) sink += lanes_sum(acc[i]);
    return sink;
}

double treespec_peak_flops(int isa, int64_t iterations) {
    double start = 0.0, seconds = 0.0, sink = 0.0;
    int threads = 1;
#pragma omp parallel reduction(+ : sink)
    {
#pragma omp single
        threads = omp_get_num_threads();
#pragma omp barrier
#pragma omp master
        start = omp_get_wtime();
        sink += isa == ISA_AMX ? peak_amx(iterations / 64) : isa == ISA_AVX512_BF16 ? peak_bf16(iterations) : peak_fma(iterations);
#pragma omp barrier
#pragma omp master
        seconds = omp_get_wtime() - start;
    }
    if (sink == -1.0) return 0.0; /* keeps the chains live */
    if (isa == ISA_AMX) return (double)threads * (double)(iterations / 64) * 4.0 * 16384.0 / seconds;
    return (double)threads * (double)iterations * 12.0 * (isa == ISA_AVX512_BF16 ? 64.0 : 16.0) / seconds;
}
