/* y = x @ W^T on the CPU for W in one of GGUF's block formats, without dequantizing W in memory.
 *
 * Built by quantized_linear.py on first use (cc -O3 -march=native -fopenmp) and called through
 * ctypes. Plain C with GCC vector extensions, so the one source vectorises for AVX-512, AVX2 or
 * NEON alike, and builds in well under a second with no torch headers.
 *
 * A weight is N rows of K values, cut along K into blocks of 32 that share a scale d (and, for
 * Q4_1, an offset m); both are stored here as float32 arrays [N][K/32] (GGUF keeps fp16: the
 * conversion is exact). Values:
 *   Q4_0  d * (q - 8)   q in 0..15, 16 bytes a block: byte j holds q[j] (low nibble), q[j+16] (high)
 *   Q4_1  d * q + m     same nibbles
 *   Q8_0  d * q         q int8, 32 bytes a block
 * Each product d * q is exact in float32 (an fp16 significand times a 4- or 8-bit integer), so
 * computing d * q + m with or without a fused multiply-add rounds once, at the addition, exactly
 * as gguf-py's dequantize does in numpy: the values a row is multiplied by are bit for bit the
 * dequantized weights. Only the order of the dot products' additions differs from a BLAS on the
 * dequantized matrix (float32 rounding).
 *
 * The work is split over output rows. A thread dequantizes rows of W into a small buffer, then
 * multiplies them with every row of x in MR x NR register tiles: one pass over W's bytes per call
 * whatever M is, which is the point at decode (M = batch size, W read from DRAM once). The rows
 * past the last MR-row tile (M mod MR) go through one tile of their height (3, 2 or 1 rows: each
 * tile reads its NR weight vectors once a step of k), and a tile sums its mr x NR dot products
 * together through a transpose (AVX-512), about a third of the cost of 16 horizontal sums.
 *  - M < BLOCK_M (decode, prompt-lookup verify steps, short prefill chunks): NR rows a buffer
 *    (L1-resident), each met by all of x.
 *  - M >= BLOCK_M (prefill): up to NC_MAX rows a buffer (L2-resident), and each MR-row tile of x
 *    meets all of them while it sits in L1, so x is read from L2/L3 once per buffer rather than
 *    once per NR rows (x is 1.2 MB at M = 512, K = 576; 3 MB at K = 1536, more than a core's L2).
 *    2-core EPYC (Zen 5), Q4_1 [3072 x 576] at M = 512: 4.8 ms (375 GFLOP/s), against 7.0 ms with
 *    NR-row buffers only and 8.0 ms for torch's GEMM on the dequantized matrix.
 * 2-core Intel Xeon (AVX-512; 4 MB L2 in all, 48 KB L1d a core), 2 threads, the embedded model's
 * Q4_1 gate_up [3072 x 576] and Q8_0 lm_head [49152 x 576], ms a call
 * (benchmarks/quantized_linear_rows.py; the machine shared, so +-10%):
 *     M                     1      2      3      4      6      8     11     12     16
 *     gate_up           0.084  0.092  0.106  0.109  0.146  0.161  0.215  0.214  0.268
 *     lm_head           1.16   1.31   1.56   1.58   2.20   2.43   3.28   3.28   4.14
 *     gate_up, before   0.095  0.122  0.151  0.130  0.195  0.208  0.317  0.267  0.317
 *     lm_head, before   1.36   1.69   2.19   1.85   2.89   3.23   4.97   4.10   4.94
 * "before": a tile of one row for each row past the last MR-row tile (M = 11 cost what M = 16
 * did), horizontal sums wherever a tile had fewer than 16 outputs, BLOCK_M = 8. With the sums
 * transposed the NR-row buffers are the faster here at every M below 64 (gate_up, 2 threads:
 * M = 8, 0.161 against 0.210 ms blocked; M = 63, 0.95 against 1.02), the two about even from 96
 * to 256, and the blocked path far ahead at 512 (one thread: 14.5 against 17.4 ms; down
 * [576 x 1536], 7.6 against 15.8).
 * Every path sums each output in the same order (16 lanes, each over k = lane mod 16 in order,
 * then the lanes 0..15 in turn), so a row of y is bit for bit the same whatever M is and
 * whichever path ran.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

#define VL 16   /* floats per vector */
#define NR 4    /* weight rows per tile */
#define MR 4    /* x rows per tile */
#define BLOCK_M 64   /* rows of x from which a buffer holds up to NC_MAX rows of W (the tests take
                        M = 64..67 for the blocked path) */
#define NC_MAX 64
#define NC_BYTES (192 * 1024)         /* ... and at most this many bytes (a core's L2 is 1-2 MB) */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4)));          /* unaligned loads */

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

/* 16 bytes to 16 floats. With intrinsics where there are: GCC 12 turns the portable spelling
 * (__builtin_convertvector of a byte vector) into 16 scalar conversions in these loops. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf u8_to_float(__m128i b) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
static inline vf s8_to_float(__m128i b) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vf halves(__m256 a, __m256 b) {
    vf r;
    memcpy(&r, &a, 32);
    memcpy((char *)&r + 32, &b, 32);
    return r;
}
static inline vf u8_to_float(__m128i b) {
    return halves(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}
static inline vf s8_to_float(__m128i b) {
    return halves(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
#endif

/* q[0..15] and q[16..31] of a 4-bit block; the 16 values of half an 8-bit block. */
static inline void nibbles_to_float(const uint8_t *p, vf *lo, vf *hi) {
#if defined(__AVX512F__) || defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
    *lo = u8_to_float(_mm_and_si128(b, mask));
    *hi = u8_to_float(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
#else
    for (int j = 0; j < VL; j++) {
        (*lo)[j] = (float)(p[j] & 15);
        (*hi)[j] = (float)(p[j] >> 4);
    }
#endif
}

static inline vf int8_to_float(const uint8_t *p) {
#if defined(__AVX512F__) || defined(__AVX2__)
    return s8_to_float(_mm_loadu_si128((const __m128i *)p));
#else
    vf r;
    for (int j = 0; j < VL; j++) r[j] = (float)(int8_t)p[j];
    return r;
#endif
}

/* Row n of W as K floats. qs: the row's quant bytes; d, m: its nb scales / offsets. */
static void dequant_row(int qtype, const uint8_t *qs, const float *d, const float *m, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++) {
        vf lo, hi;
        if (qtype == Q8_0) {
            lo = int8_to_float(qs + 32 * b) * d[b];
            hi = int8_to_float(qs + 32 * b + 16) * d[b];
        } else {
            nibbles_to_float(qs + 16 * b, &lo, &hi);
            if (qtype == Q4_0) {
                lo = (lo - 8.0f) * d[b];
                hi = (hi - 8.0f) * d[b];
            } else {
                lo = lo * d[b] + m[b];
                hi = hi * d[b] + m[b];
            }
        }
        *(vf_u *)(out + 32 * b) = lo;
        *(vf_u *)(out + 32 * b + 16) = hi;
    }
}

#if defined(__AVX512F__)
/* r[i][j] -> r[j][i]: lane j of vector i to lane i of vector j */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    }
}
#endif

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* y[r][n0 + i] = x[r] . w[i] for r < mr, i < nr; w: NR rows of K floats. Called with constant mr,
 * nr and big so the accumulators stay in registers. A tile of NR weight rows (any mr) does its
 * mr * NR sums at once by a transpose, the vectors past mr * NR zero (AVX-512): the bits hsum
 * gives, and cheaper even than 4 horizontal sums (against hsum on this path: 12% off Q4_1
 * [3072 x 576] at M = 1, 16% at M = 4, one thread, the Xeon above). big (the large-M path): each x
 * vector is loaded into a register once rather than folded into its NR FMAs as a memory operand
 * (GCC's choice, one load an FMA); same bits. */
static inline __attribute__((always_inline)) void
tile(int mr, int nr, const float *x, int64_t K, const float *w, float *y, int64_t N, int64_t n0, int big) {
    (void)big;   /* read only where there is AVX-512 */
    vf acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nr; i++) acc[r][i] = (vf){0};
    for (int64_t k = 0; k < K; k += VL) {
        vf wv[NR];
        for (int i = 0; i < nr; i++) wv[i] = *(const vf_u *)(w + i * K + k);
        for (int r = 0; r < mr; r++) {
            vf xv = *(const vf_u *)(x + r * K + k);
#if defined(__AVX512F__)
            if (big) __asm__("" : "+v"(xv));
#endif
            for (int i = 0; i < nr; i++) acc[r][i] += xv * wv[i];
        }
    }
#if defined(__AVX512F__)
    if (nr == NR) {
        /* lane l of accumulator j is lane j of t[l]: adding t[0..15] in turn to 0 is hsum of all 16 */
        __m512 t[VL];
        for (int j = 0; j < VL; j++) t[j] = j < mr * nr ? (__m512)acc[j / nr][j % nr] : _mm512_setzero_ps();
        transpose16(t);
        __m512 s = _mm512_setzero_ps();
        for (int l = 0; l < VL; l++) s = _mm512_add_ps(s, t[l]);
        float out[VL];
        _mm512_storeu_ps(out, s);
        for (int r = 0; r < mr; r++) memcpy(y + r * N + n0, out + r * nr, nr * sizeof(float));
        return;
    }
#endif
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nr; i++) y[r * N + n0 + i] = hsum(acc[r][i]);
}

_Static_assert(MR == 4, "the rows past the last MR-row tile go through tiles of 3, 2 or 1 rows");

/* The rows past the last MR-row tile (M mod MR, any of 0..3) against NR rows of W: one tile of
 * their height, mr a constant at each call of tile, so its accumulators stay in registers. */
static inline __attribute__((always_inline)) void
tail_tile(int64_t rows, const float *x, int64_t K, const float *w, float *y, int64_t N, int64_t n0, int big) {
    switch (rows) {
    case 3: tile(3, NR, x, K, w, y, N, n0, big); break;
    case 2: tile(2, NR, x, K, w, y, N, n0, big); break;
    case 1: tile(1, NR, x, K, w, y, N, n0, big); break;
    }
}

/* Small M: y[:, n0 .. n0 + nr) for nr <= NR rows of W in w. The rows past the last MR-row tile
 * (M mod MR) go through one tile of their height, not one tile a row: each tile reads its NR
 * weight vectors once a step of k, whatever its height. */
static void rows_times_x(int nr, const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t n0) {
    int64_t r = 0;
    if (nr == NR) {
        for (; r + MR <= M; r += MR) tile(MR, NR, x + r * K, K, w, y + r * N, N, n0, 0);
        tail_tile(M - r, x + r * K, K, w, y + r * N, N, n0, 0);
    } else {
        for (; r < M; r++)
            for (int i = 0; i < nr; i++) tile(1, 1, x + r * K, K, w + i * K, y + r * N, N, n0 + i, 0);
    }
}

static int64_t row_bytes(int qtype, int64_t K) { return qtype == Q8_0 ? K : K / 2; }

/* Rows n0 .. n0 + nr of W into w, as nr rows of K floats. */
static void dequant_rows(int qtype, const uint8_t *qs, const float *d, const float *m, int64_t K, int64_t n0,
                         int nr, float *w) {
    const int64_t nb = K / 32, rb = row_bytes(qtype, K);
    for (int i = 0; i < nr; i++)
        dequant_row(qtype, qs + (n0 + i) * rb, d + (n0 + i) * nb, m ? m + (n0 + i) * nb : 0, nb, w + i * K);
}

/* Large M: y[:, n0 .. n0 + nr) for nr rows of W in w (nr a multiple of NR), each MR-row tile of x
 * against all of them in turn. Not inlined: the small-M path's code (and speed) stays its own. */
static __attribute__((noinline)) void
block_times_x(int nr, const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t n0) {
    int64_t r = 0;
    for (; r + MR <= M; r += MR)
        for (int i = 0; i < nr; i += NR) tile(MR, NR, x + r * K, K, w + i * K, y + r * N, N, n0 + i, 1);
    for (int i = 0; i < nr; i += NR) tail_tile(M - r, x + r * K, K, w + i * K, y + r * N, N, n0 + i, 1);
}

/* M >= BLOCK_M. Each thread takes an equal share of W's NR-row groups (so 576 rows split 288 / 288,
 * not in whole buffers) and runs through it a buffer of nc rows at a time. */
static int quantized_linear_blocked(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                                    const float *d, const float *m, int64_t N, float *y, int nthreads) {
    int64_t nc = NC_BYTES / (K * (int64_t)sizeof(float)) / NR * NR;
    nc = nc < NR ? NR : nc > NC_MAX ? NC_MAX : nc;
    const int64_t groups = (N + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t start = groups * t / T * NR, stop = groups * (t + 1) / T * NR, end = stop < N ? stop : N;
        float *w = aligned_alloc(64, ((nc * K * sizeof(float)) + 63) / 64 * 64);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t n0 = start; n0 < end; n0 += nc) {
                const int rows = end - n0 < nc ? (int)(end - n0) : (int)nc, full = rows / NR * NR;
                dequant_rows(qtype, qs, d, m, K, n0, rows, w);
                block_times_x(full, x, M, K, w, y, N, n0);
                if (full < rows) rows_times_x(rows - full, x, M, K, w + full * K, y, N, n0 + full);
            }
            free(w);
        }
    }
    return failed ? -1 : 0;
}

/* x: [M][K] float32; qs: [N][row_bytes]; d, m: [N][K/32] (m only for Q4_1); y: [M][N] float32. */
int quantized_linear(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                     const float *m, int64_t N, float *y, int nthreads) {
    if (M >= BLOCK_M) return quantized_linear_blocked(qtype, x, M, K, qs, d, m, N, y, nthreads);
    const int64_t tiles = (N + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* every thread must reach the omp for, so one whose buffer failed skips its tiles there */
        float *w = aligned_alloc(64, ((NR * K * sizeof(float)) + 63) / 64 * 64);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!w) continue;
            const int64_t n0 = t * NR;
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            dequant_rows(qtype, qs, d, m, K, n0, nr, w);
            rows_times_x(nr, x, M, K, w, y, N, n0);
        }
        free(w);
    }
    return failed ? -1 : 0;
}
