/* CPU kernels for the torch engine's packed weight formats (weight_format = "int8" and "int4").
 *
 * At batch 1 a decode step reads every weight once, and on a small CPU the float kernels cannot
 * keep up with memory: converting each weight to float costs more than reading it. Here weights
 * are 8- or 4-bit with a float scale and minimum per group of G inputs (G a multiple of 16),
 * activations are quantized per row to int16 (32,767 levels either side of zero), and the dot
 * products run on integer units: 16 weights widened to int16, one multiply-add of pairs into
 * int32 (vpmaddwd), one add. A group's int32 sums become float once. 4-bit weights cost two more
 * instructions per 32 (split the nibbles) and read 0.75 bytes a weight instead of 1.25.
 *
 * With AVX-512 VNNI (RK_VNNI) vpdpwssd does the multiply-add and the add in one instruction on 16
 * int32 lanes (two pair-steps of one tile in the narrow loop, two tiles' channels in the wide
 * one); per row the int32 sums and float steps are those of the AVX2 loops, so every build with
 * SIMD gives the same bits.
 *
 * A tile's weights, scales and minimums follow each other in one sequential stream per thread
 * (rows read side by side at their own addresses defeated the hardware prefetcher: 3 against 14 G
 * weights/s).
 *
 * The int16 rounding is absolute: 1/65,534 of the row's largest value. A row with an outlier
 * 1,000 times its typical size keeps its other values to about 1% (float16: 0.02%); on SmolLM2
 * the format's distance from float32 is dominated by the weights (bench/int8_quality.py). Per-group
 * activation scales would be the next step for models with larger outliers.
 *
 * Built once per machine by backends/torch/native.py (cc -O3 -march=native -ffp-contract=off
 * -fopenmp) and called through ctypes. OpenMP resolves to the libgomp torch already loaded (same
 * soname), so these loops share torch's thread pool and its thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RK_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RK_VNNI 1
#endif
/* acc + the products of w and b's int16 pairs, summed in pairs (exact: int16 inputs, int32 sums,
 * no saturation): one vpdpwssd with AVX-VNNI (the VEX form of Intel's client cores since Alder
 * Lake, which lack AVX-512), else vpmaddwd and an add. The same bits either way. The narrow loop
 * only: in the wide one, whose few accumulators each take a product every step, vpdpwssd's
 * latency (it waits for its accumulator, where vpmaddwd does not) made 16 to 64 rows 8-18%
 * slower (bench/decode_kernels.py --builds, docs/benchmarks.md). */
#if defined(__AVXVNNI__)
#define MADD_ADD(acc, w, b) _mm256_dpwssd_avx_epi32((acc), (w), (b))
#else
#define MADD_ADD(acc, w, b) _mm256_add_epi32((acc), _mm256_madd_epi16((w), (b)))
#endif
#endif

int rk_abi(void) { return 22; }

int rk_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* 0: scalar loops; 1: AVX2; 2: AVX2 and AVX-512 VNNI (both matmul loops multiply-add with vpdpwssd). */
int rk_simd(void) {
#if defined(RK_VNNI)
    return 2;
#elif defined(RK_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* 1 where the AVX2 narrow loop multiply-adds with AVX-VNNI's vpdpwssd (MADD_ADD), else 0. */
int rk_avx_vnni(void) {
#if defined(RK_AVX2) && defined(__AVXVNNI__) && !defined(RK_VNNI) /* with AVX-512 VNNI the narrow loop is its own */
    return 1;
#else
    return 0;
#endif
}

/* One row (K floats) to int16 in q (Kp >= K entries, tail zero); returns the row's scale. The
 * vector and scalar loops compute the same values (x * inv rounded to nearest even). */
static float quantize_row(const float *x, int64_t K, int64_t Kp, int16_t *q) {
    int64_t k = 0;
    float mx = 0.f;
#ifdef RK_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 vmx = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) vmx = _mm256_max_ps(vmx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmx);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
#endif
    for (; k < K; k++) {
        float a = fabsf(x[k]);
        mx = a > mx ? a : mx;
    }
    float d = mx > 0.f ? mx / 32767.f : 1.f, inv = 1.f / d;
    k = 0;
#ifdef RK_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; k + 16 <= K; k += 16) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv));
        /* packs works within 128-bit lanes: a0 b0 a1 b1, put back in order */
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8));
    }
#endif
    for (; k < K; k++) q[k] = (int16_t)lrintf(x[k] * inv);
    for (; k < Kp; k++) q[k] = 0;
    return d;
}

#ifdef RK_AVX2
/* e^x for 8 floats, to about 2 ulp (x clamped to [-87, 88]: SiLU and softmax need no more, a
 * softmax weight of e^-87 against the largest one's 1 is nothing): e^x = 2^n e^r,
 * n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its degree-6 Taylor polynomial. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln 2 in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* x [M, K] (row stride xs) -> q [M, Kp] int16, dq [M]. */
void rk_quantize_rows(const float *x, int64_t M, int64_t K, int64_t xs, int64_t Kp, int16_t *q, float *dq) {
    for (int64_t m = 0; m < M; m++) dq[m] = quantize_row(x + m * xs, K, Kp, q + m * Kp);
}

/* RMSNorm's scale of one row of K: rsqrt(mean(x^2) + eps), as Hugging Face computes it. */
static inline float rms_inv(const float *x, int64_t K, float eps) {
    float ss = 0.f;
    for (int64_t k = 0; k < K; k++) ss += x[k] * x[k];
    return 1.f / sqrtf(ss / (float)K + eps);
}

/* One row's RMSNorm: out = weight * (r * rms_inv). */
static inline void rmsnorm_row(const float *r, int64_t K, const float *weight, float eps, float *out) {
    const float inv = rms_inv(r, K, eps);
    for (int64_t k = 0; k < K; k++) out[k] = weight[k] * (r[k] * inv);
}

/* One row's LayerNorm: out = (r - mean) rsqrt(variance + eps) weight + bias (bias NULL: none),
 * the variance over the centred row, as torch's layer_norm computes it in float32. */
static inline void layernorm_row(const float *r, int64_t K, const float *weight, const float *bias, float eps,
                                 float *out) {
    float mean = 0.f, var = 0.f;
    for (int64_t k = 0; k < K; k++) mean += r[k];
    mean /= (float)K;
    for (int64_t k = 0; k < K; k++) var += (r[k] - mean) * (r[k] - mean);
    const float inv = 1.f / sqrtf(var / (float)K + eps);
    for (int64_t k = 0; k < K; k++) out[k] = (r[k] - mean) * inv * weight[k] + (bias ? bias[k] : 0.f);
}

/* RMSNorm (x * rms_inv, times the weight), then quantized as rk_quantize_rows. tmp: K floats of
 * scratch. */
void rk_rmsnorm_quantize(const float *x, int64_t M, int64_t K, int64_t xs, const float *weight, float eps,
                         float *tmp, int64_t Kp, int16_t *q, float *dq) {
    for (int64_t m = 0; m < M; m++) {
        rmsnorm_row(x + m * xs, K, weight, eps, tmp);
        dq[m] = quantize_row(tmp, K, Kp, q + m * Kp);
    }
}

/* gate / (1 + e^(-z)) * up for rows [gate (I) | up (I)], quantized: SwiGLU's silu(gate) * up with
 * z = gate, or (gelu) GeGLU's gelu(gate) * up in GELU's tanh form (Gemma's gelu_pytorch_tanh) with
 * z = 2u, u = sqrt(2 / pi) (g + 0.044715 g^3): 0.5 g (1 + tanh(u)) is g / (1 + e^(-2u)). tmp: I
 * floats. Inlined once per activation, so neither loop branches on it. */
static inline __attribute__((always_inline)) void gated_mul_quantize(const float *gu, int64_t M, int64_t I, int64_t gs,
                                                                      float *tmp, int64_t Kp, int16_t *q, float *dq,
                                                                      const int gelu) {
    const float c = 0.7978845608028654f, c3 = 0.7978845608028654f * 0.044715f;
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * gs, *u = g + I;
        int64_t i = 0;
#ifdef RK_AVX2
        const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
        const __m256 m2c = _mm256_set1_ps(-2.f * c), m2c3 = _mm256_set1_ps(-2.f * c3);
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            /* -z: -g, or -2u = g (-2c + -2c3 g^2) */
            const __m256 arg = gelu ? _mm256_mul_ps(gv, _mm256_add_ps(m2c, _mm256_mul_ps(m2c3, _mm256_mul_ps(gv, gv))))
                                    : _mm256_xor_ps(gv, sign);
            const __m256 den = _mm256_add_ps(one, exp8(arg));
            _mm256_storeu_ps(tmp + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) {
            const float arg = gelu ? g[i] * (-2.f * c + -2.f * c3 * (g[i] * g[i])) : -g[i];
            tmp[i] = g[i] / (1.f + expf(arg)) * u[i];
        }
        dq[m] = quantize_row(tmp, I, Kp, q + m * Kp);
    }
}

void rk_silu_mul_quantize(const float *gu, int64_t M, int64_t I, int64_t gs, float *tmp, int64_t Kp, int16_t *q,
                          float *dq) {
    gated_mul_quantize(gu, M, I, gs, tmp, Kp, q, dq, 0);
}

void rk_gelu_tanh_mul_quantize(const float *gu, int64_t M, int64_t I, int64_t gs, float *tmp, int64_t Kp,
                               int16_t *q, float *dq) {
    gated_mul_quantize(gu, M, I, gs, tmp, Kp, q, dq, 1);
}

/* RMSNorm of each row of y [M, K] times weight, added to x [M, K]: Gemma 2/3's norm of a block's
 * output before its residual add. */
static void rmsnorm_add(const float *y, int64_t M, int64_t K, const float *weight, float eps, float *x) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = y + m * K;
        float *o = x + m * K;
        const float inv = rms_inv(r, K, eps);
        for (int64_t k = 0; k < K; k++) o[k] += weight[k] * (r[k] * inv);
    }
}

/* x [M, K] += y [M, K] * scale: Granite's scaled residual add (residual_multiplier), the product
 * rounded before the sum as torch computes x + y * scale. */
static void scaled_add(const float *y, int64_t M, int64_t K, float scale, float *x) {
    for (int64_t i = 0; i < M * K; i++) x[i] += y[i] * scale;
}

/* The KV cache's element types (kv_cache_dtype): float32, or float16 and bfloat16 at half the
 * bytes. A key or value is rounded to nearest even when written, as torch's .to() rounds it (so
 * the torch path and this one write the same bits), and widened to float32 when read: the
 * attention computes in float32 either way. */
enum { RK_F32 = 0, RK_F16 = 1, RK_BF16 = 2 };

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> float16, nearest even; 65,520 and above become infinity, NaN stays NaN. */
static inline uint16_t f16_round(float f) {
    uint32_t x = bits_of(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7fffffffu;
    uint16_t h;
    if (x >= 0x47800000u) /* 2^16 and above, infinities, NaN */
        h = x > 0x7f800000u ? 0x7e00 : 0x7c00;
    else if (x < 0x38800000u) /* below 2^-14: float16's subnormals, whose step (2^-24) is 0.5's ulp */
        h = (uint16_t)(bits_of(float_of(x) + 0.5f) - 0x3f000000u);
    else /* exponent rebased (-112 << 23), then half the dropped 13 bits' range, ties to even */
        h = (uint16_t)((x + 0xc8000fffu + ((x >> 13) & 1)) >> 13);
    return h | sign;
}

static inline float f16_widen(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return float_of(sign | 0x7f800000u | m << 13);
    if (e == 0) return float_of(sign | bits_of((float)m * 0x1p-24f));
    return float_of(sign | (e + 112) << 23 | m << 13);
}

/* float32 -> bfloat16, nearest even (torch's rounding; NaN becomes its quiet NaN). */
static inline uint16_t bf16_round(float f) {
    const uint32_t x = bits_of(f);
    if (f != f) return 0x7fc0;
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

static inline float kv_load(const void *c, int64_t i, const int kind) {
    if (kind == RK_F32) return ((const float *)c)[i];
    const uint16_t h = ((const uint16_t *)c)[i];
    return kind == RK_F16 ? f16_widen(h) : float_of((uint32_t)h << 16);
}

/* n floats of x into the cache from element i. */
static void kv_store(void *c, int64_t i, const float *x, int64_t n, int kind) {
    if (kind == RK_F32) {
        memcpy((float *)c + i, x, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)c + i;
    for (int64_t j = 0; j < n; j++) h[j] = kind == RK_F16 ? f16_round(x[j]) : bf16_round(x[j]);
}

#ifdef RK_AVX2
static inline __m256 kv_load8(const void *c, int64_t i, const int kind) {
    if (kind == RK_F32) return _mm256_loadu_ps((const float *)c + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)c + i));
    if (kind == RK_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* q . cache[at .. at + n) */
static inline float dot(const float *q, const void *c, int64_t at, int64_t n, const int kind) {
    int64_t i = 0;
    float s = 0.f;
#ifdef RK_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load8(c, at + i, kind), acc);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    s = _mm_cvtss_f32(lo);
#endif
    for (; i < n; i++) s += q[i] * kv_load(c, at + i, kind);
    return s;
}

/* y += a * cache[at .. at + n) */
static inline void axpy(float *y, float a, const void *c, int64_t at, int64_t n, const int kind) {
    int64_t i = 0;
#ifdef RK_AVX2
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, kv_load8(c, at + i, kind), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * kv_load(c, at + i, kind);
}

/* Rotary embedding in place on `heads` vectors of D: x * cos + roll(x, D/2) * signed_sin. */
static void rotate(float *x, int64_t heads, int64_t D, const float *cos, const float *ssin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * D;
        for (int64_t d = 0; d < half; d++) {
            const float lo = v[d], hi = v[d + half];
            v[d] = lo * cos[d] + hi * ssin[d];
            v[d + half] = hi * cos[d + half] + lo * ssin[d + half];
        }
    }
}

/* Ask for one head's rows of the block holding position p (from p to the block's end or `end`):
 * blocks are scattered over the cache, so the hardware prefetcher, which follows one address
 * stream, loses the way at every block, and each block's first rows would wait for memory. */
static inline void prefetch_block(const void *c, const int64_t *tab, int64_t p, int64_t end, int64_t bs,
                                  int64_t stride, int64_t kvh, int64_t D, int64_t esize) {
    if (p >= end) return;
    const int64_t off = p % bs, n = bs - off < end - p ? bs - off : end - p;
    const char *row = (const char *)c + ((tab[p / bs] * bs + off) * stride + kvh * D) * esize;
    for (int64_t i = 0; i < n; i++, row += stride * esize)
        for (int64_t b = 0; b < D * esize; b += 64) __builtin_prefetch(row + b);
}

#ifdef RK_AVX2
/* dot(q, cache, at + j * stride, D) for the 8 keys j = 0..7, D a multiple of 8: eight chains of
 * multiply-adds side by side (dot() runs one per key, each waiting on the last), then the same
 * pairwise sums as dot()'s, eight at a time, so the same bits. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const void *c, int64_t at, int64_t stride,
                                                        int64_t D, const int kind) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qd, kv_load8(c, at + j * stride + d, kind), a[j]);
    }
    __m256 t[4]; /* [lo + hi of key 2j | lo + hi of key 2j + 1] */
    for (int j = 0; j < 4; j++)
        t[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x31));
    __m256 u[2]; /* elements 0 + 2 and 1 + 3 of each half */
    for (int j = 0; j < 2; j++) {
        const __m256d x = _mm256_castps_pd(t[2 * j]), y = _mm256_castps_pd(t[2 * j + 1]);
        u[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    const __m256 sums = _mm256_hadd_ps(u[0], u[1]); /* keys 0 2 4 6 | 1 3 5 7 */
    return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#endif

/* RK_SHARE: query heads at most that one pass over a KV head's keys and values serves. */
#define RK_SHARE 8

#ifdef RK_AVX2
/* o[g] += sum over positions [p, p + n) of s[g][p - start] * inv[g] * v[p], for the nh heads g,
 * D a multiple of 64: 64 outputs at a time in eight registers, where axpy() loads and stores them
 * for every position. A block's values stay in the L1 cache for the heads after the first. The
 * same multiply-adds in the same order as axpy()'s, so the same bits. */
static inline __attribute__((always_inline)) void weighted_values(
    float *o, int64_t nh, const float *s, int64_t ss, const float *inv, const void *v_cache, int64_t at, int64_t p,
    int64_t n, int64_t start, int64_t stride, int64_t D, const int kind) {
    for (int64_t g = 0; g < nh; g++)
        for (int64_t d = 0; d < D; d += 64) {
            float *out = o + g * D + d;
            const float *w = s + g * ss + p - start;
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(out + 8 * j);
            int64_t x = at + d;
            for (int64_t i = 0; i < n; i++, x += stride) {
                const __m256 wi = _mm256_set1_ps(w[i] * inv[g]);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(wi, kv_load8(v_cache, x + 8 * j, kind), a[j]);
            }
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + 8 * j, a[j]);
        }
}
#endif

/* nh query heads (at most RK_SHARE) on one KV head: o[g] [D] = softmax(q[g] . keys * scale) .
 * values over positions [start, end) of the sequence whose block table is tab; q and o hold
 * the heads D apart. s: nh rows of scratch, ss floats apart. Each key and value is read from
 * memory once for all the heads (GQA: 3 query heads share a KV head in SmolLM2), and a block's
 * rows are fetched while the one before is computed. Inlined once per element type, so each
 * loop reads its cache's type without a branch. softcap > 0: each score becomes
 * softcap tanh(score / softcap) before the softmax (Gemma 2). alibi: each head's ALiBi slope (BLOOM,
 * MPT, Falcon-RW), which times the key's distance back from the query (at end - 1) is taken from
 * its score; NULL: none. */
static inline __attribute__((always_inline)) void attend(
    const float *q, int64_t nh, const void *k_cache, const void *v_cache, const int64_t *tab, int64_t start,
    int64_t end, int64_t bs, int64_t stride, int64_t kvh, int64_t D, float scale, float softcap, const float *sinks,
    const float *alibi, float *s, int64_t ss, float *o, const int kind) {
    const int64_t esize = kind == RK_F32 ? 4 : 2;
    float mx[RK_SHARE], inv[RK_SHARE];
    /* gpt-oss's sinks: each head's learned logit joins its softmax (in the maximum and the sum)
     * and takes its share of no value. */
    for (int64_t g = 0; g < nh; g++) mx[g] = sinks ? sinks[g] : -INFINITY;
    for (int64_t p = start; p < end;) { /* a block's run of positions at a time */
        const int64_t off = p % bs, n = bs - off < end - p ? bs - off : end - p;
        const int64_t at = (tab[p / bs] * bs + off) * stride + kvh * D;
        prefetch_block(k_cache, tab, p + n, end, bs, stride, kvh, D, esize);
        int64_t i = 0;
#ifdef RK_AVX2
        if (D % 8 == 0)
            for (; i + 8 <= n; i += 8)
                for (int64_t g = 0; g < nh; g++) {
                    float *to = s + g * ss + p - start + i;
                    const __m256 v = dot8(q + g * D, k_cache, at + i * stride, stride, D, kind);
                    _mm256_storeu_ps(to, _mm256_mul_ps(v, _mm256_set1_ps(scale)));
                    if (softcap > 0.f)
                        for (int j = 0; j < 8; j++) to[j] = tanhf(to[j] / softcap) * softcap;
                    if (alibi)
                        for (int j = 0; j < 8; j++) to[j] += alibi[g] * (float)(p + i + j - (end - 1));
                    for (int j = 0; j < 8; j++) mx[g] = to[j] > mx[g] ? to[j] : mx[g];
                }
#endif
        for (; i < n; i++)
            for (int64_t g = 0; g < nh; g++) {
                float v = dot(q + g * D, k_cache, at + i * stride, D, kind) * scale;
                if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
                if (alibi) v += alibi[g] * (float)(p + i - (end - 1));
                s[g * ss + p - start + i] = v;
                mx[g] = v > mx[g] ? v : mx[g];
            }
        p += n;
    }
    prefetch_block(v_cache, tab, start, end, bs, stride, kvh, D, esize); /* the values' first block */
    for (int64_t g = 0; g < nh; g++) {
        float *sg = s + g * ss, total = 0.f;
        int64_t p = 0;
#ifdef RK_AVX2
        __m256 vt = _mm256_setzero_ps();
        for (; p + 8 <= end - start; p += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + p), _mm256_set1_ps(mx[g])));
            _mm256_storeu_ps(sg + p, e);
            vt = _mm256_add_ps(vt, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vt);
        for (int j = 0; j < 8; j++) total += lanes[j];
#endif
        for (; p < end - start; p++) {
            sg[p] = expf(sg[p] - mx[g]);
            total += sg[p];
        }
        if (sinks) total += expf(sinks[g] - mx[g]);
        inv[g] = 1.f / total;
    }
    memset(o, 0, (size_t)(nh * D) * sizeof(float));
    for (int64_t p = start; p < end;) {
        const int64_t off = p % bs, n = bs - off < end - p ? bs - off : end - p;
        const int64_t at = (tab[p / bs] * bs + off) * stride + kvh * D;
        prefetch_block(v_cache, tab, p + n, end, bs, stride, kvh, D, esize);
#ifdef RK_AVX2
        if (D % 64 == 0) {
            weighted_values(o, nh, s, ss, inv, v_cache, at, p, n, start, stride, D, kind);
            p += n;
            continue;
        }
#endif
        for (int64_t g = 0; g < nh; g++)
            for (int64_t i = 0; i < n; i++)
                axpy(o + g * D, s[g * ss + p - start + i] * inv[g], v_cache, at + i * stride, D, kind);
        p += n;
    }
}

/* One step's attention for M rows (new tokens) over the paged KV cache.
 *
 * qkv [M, (H + 2 KVH) D] (row stride qs): q, k, v of the new tokens, before rotary; q and k are
 * rotated in place. k and v are written to the cache at slot[m]; then every head attends over
 * positions [start, len[m]) of its row's sequence, a position's slot being
 * table[tab_of[m], p / bs] * bs + p % bs (start = len - window with a sliding window, else 0).
 * A decoding sequence is one row; a prompt chunk is one row per token, each with its own position
 * and length over the same table row, so it attends causally to the chunk's earlier tokens (every
 * row's keys are in the cache before any row attends).
 * cos, ssin: [max_len, D] tables (see model.Rotary); NULL: the layer does not rotate (SmolLM3's
 * NoPE layers). q_scales: [max_len] factors on the rotated queries by position (Ministral 3), or
 * NULL. out [M, H D]. scratch: RK_SHARE * max_len
 * floats for each of the rk_threads() threads. kind: the caches' element type (RK_F32, RK_F16,
 * RK_BF16).
 *
 * The work is cut into units, a row's query heads on one KV head each (or a single head, when
 * there are too few rows to keep every thread busy), shared out between threads (see the
 * schedule below). The cache is walked a block at a time (the positions of a block are
 * consecutive slots), and its rows come from memory every step (the weights have pushed them out
 * of cache), so long contexts are bound by reading them: 16-bit caches read half as much.
 */
static void attention(float *qkv, int64_t M, int64_t qs, int64_t H, int64_t KVH, int64_t D, const int64_t *pos,
                      const float *cos, const float *ssin, void *k_cache, void *v_cache, const int64_t *slot,
                      const int64_t *table, int64_t tw, const int64_t *tab_of, const int64_t *len, int64_t bs,
                      int64_t window, float scale, float softcap, const float *sinks, const float *alibi,
                      const float *q_scales, int64_t max_len, int kind, float *scratch, float *out) {
    const int64_t group = H / KVH, stride = KVH * D;
    for (int64_t m = 0; m < M; m++) {
        float *row = qkv + m * qs;
        if (cos) rotate(row, H + KVH, D, cos + pos[m] * D, ssin + pos[m] * D);
        if (q_scales)
            for (int64_t i = 0; i < H * D; i++) row[i] *= q_scales[pos[m]];
        kv_store(k_cache, slot[m] * stride, row + H * D, stride, kind);
        kv_store(v_cache, slot[m] * stride, row + (H + KVH) * D, stride, kind);
    }
    /* Units: a row's heads on one KV head together (up to RK_SHARE of them), so its keys and
     * values are read once; with fewer than two such units per thread, a head each instead, so
     * that one sequence's attention still has work for every thread. From 4 rows per thread,
     * threads take whole rows in turn (neighbouring rows of a prompt chunk attend to about as many
     * positions, so turns even out their lengths); fewer rows are cut into one run of units per
     * thread. Only the first few tokens stay on one thread: waking the team costs more than the
     * work. */
    const int64_t threads = rk_threads();
    const int64_t heads = M * KVH >= 2 * threads ? (group < RK_SHARE ? group : RK_SHARE) : 1;
    const int64_t per_kvh = (group + heads - 1) / heads, per_row = KVH * per_kvh, units = M * per_row;
    const int64_t share = M >= 4 * threads ? per_row : (units + threads - 1) / threads;
#pragma omp parallel for schedule(static, share) if (M * H * max_len >= 512)
    for (int64_t u = 0; u < units; u++) {
        const int64_t m = u / per_row, kvh = u % per_row / per_kvh, h = kvh * group + u % per_kvh * heads;
        const int64_t nh = (kvh + 1) * group - h < heads ? (kvh + 1) * group - h : heads;
        const float *q = qkv + m * qs + h * D;
        const int64_t *tab = table + tab_of[m] * tw;
        const int64_t end = len[m], start = window > 0 && end > window ? end - window : 0;
        float *s = scratch + thread_index() * RK_SHARE * max_len, *o = out + m * H * D + h * D;
        const float *sk = sinks ? sinks + h : NULL, *al = alibi ? alibi + h : NULL;
        if (kind == RK_F16)
            attend(q, nh, k_cache, v_cache, tab, start, end, bs, stride, kvh, D, scale, softcap, sk, al, s, max_len, o,
                   RK_F16);
        else if (kind == RK_BF16)
            attend(q, nh, k_cache, v_cache, tab, start, end, bs, stride, kvh, D, scale, softcap, sk, al, s, max_len, o,
                   RK_BF16);
        else
            attend(q, nh, k_cache, v_cache, tab, start, end, bs, stride, kvh, D, scale, softcap, sk, al, s, max_len, o,
                   RK_F32);
    }
}

/* attention() with its scratch; 0 when that cannot be allocated. */
int rk_decode_attention(float *qkv, int64_t M, int64_t qs, int64_t H, int64_t KVH, int64_t D, const int64_t *pos,
                        const float *cos, const float *ssin, void *k_cache, void *v_cache, const int64_t *slot,
                        const int64_t *table, int64_t tw, const int64_t *tab_of, const int64_t *len, int64_t bs,
                        int64_t window, float scale, float softcap, int64_t max_len, int kind, float *out) {
    float *scratch = malloc((size_t)(rk_threads() * RK_SHARE * max_len) * sizeof(float));
    if (!scratch) return 0;
    attention(qkv, M, qs, H, KVH, D, pos, cos, ssin, k_cache, v_cache, slot, table, tw, tab_of, len, bs, window,
              scale, softcap, NULL, NULL, NULL, max_len, kind, scratch, out);
    free(scratch);
    return 1;
}

/* Layout of a packed weight (see quantize.pack_weight): tiles of TILE output channels; in a tile,
 * per group of G inputs, a header of TILE float scales and TILE float minimums, then the weights
 * in steps of 16 bytes:
 *   8 bits: G / 2 steps, step p holding inputs 2p and 2p + 1 of each of the TILE channels in turn;
 *   4 bits: G / 4 steps, byte 2c + j of step p holding input 4p + j of channel c in its low
 *           nibble and input 4p + 2 + j in its high one (j = 0, 1).
 * Widened to int16 and multiplied-and-paired (vpmaddwd) with those two inputs broadcast, 16
 * weights leave each channel's partial sum in its own int32 lane: no horizontal sums, and one
 * widening serves every row of the batch. */
#define TILE 8

static inline int64_t group_bytes(int64_t G, int bits) { return 8 * TILE + TILE * G * bits / 8; }

/* Rows m .. m + rows - 1 of out, channels n .. n + width - 1 (those below N), from res (row stride
 * rs): res * dq[row] + bias, stored or added. Both matmul loops end here, so a row gets the same
 * bits whichever of them computed it. */
static inline void store_rows(const float *res, int64_t rs, int64_t m, int64_t rows, const float *dq, int64_t n,
                              int64_t width, int64_t N, const float *bias, float *out, int64_t os, int accumulate) {
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + (m + r) * os + n;
        for (int64_t c = 0; c < width && n + c < N; c++) {
            const float v = res[r * rs + c] * dq[m + r] + (bias ? bias[n + c] : 0.f);
            o[c] = accumulate ? o[c] + v : v;
        }
    }
}

#ifdef RK_AVX2
/* One group of one tile (its packed weights u) against R rows (R <= 4) of the batch (x: the
 * group's first input, row stride Kp): per row, each channel's int32 sum of products (channel c
 * in lane c). With AVX-512 VNNI one zmm holds two pair-steps of the tile (lanes 0-7 the first,
 * 8-15 the second), one vpdpwssd a row multiplies and adds both, and the halves are added at the
 * end; with AVX2, vpmaddwd and an add per pair-step (MADD_ADD: one vpdpwssd with AVX-VNNI). The
 * sums are exact either way. */
static inline __attribute__((always_inline)) void group_sums(const uint8_t *u, int64_t G, const int bits,
                                                             const int16_t *x, int64_t Kp, const int R,
                                                             __m256i *sums) {
    const __m128i nibble = _mm_set1_epi8(0x0f);
#ifdef RK_VNNI
    /* a row's two int16 pairs (pair-steps 2p and 2p + 1) spread over lanes 0-7 and 8-15 */
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i a[4];
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_si512();
    for (int64_t p = 0; p < G / 4; p++) {
        __m512i wv;
        if (bits == 8) { /* pair-steps 2p and 2p + 1: 32 bytes in a row */
            if ((p & 1) == 0) _mm_prefetch((const char *)(u + 32 * p + 2048), _MM_HINT_T0);
            wv = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(u + 32 * p)));
        } else { /* low nibbles pair-step 2p, high ones 2p + 1 */
            if ((p & 3) == 0) _mm_prefetch((const char *)(u + 16 * p + 1024), _MM_HINT_T0);
            const __m128i v = _mm_loadu_si128((const __m128i *)(u + 16 * p));
            wv = _mm512_cvtepu8_epi16(
                _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nibble), _mm_and_si128(v, nibble)));
        }
        for (int r = 0; r < R; r++) {
            const __m512i b = _mm512_permutexvar_epi32(
                spread, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(x + r * Kp + 4 * p))));
            a[r] = _mm512_dpwssd_epi32(a[r], wv, b);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = _mm256_add_epi32(_mm512_castsi512_si256(a[r]), _mm512_extracti64x4_epi64(a[r], 1));
#else
    for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
    if (bits == 8) {
        for (int64_t p = 0; p < G / 2; p++) {
            if ((p & 3) == 0) _mm_prefetch((const char *)(u + 16 * p + 2048), _MM_HINT_T0);
            const __m256i wv = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(u + 16 * p)));
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, x + r * Kp + 2 * p, sizeof pair);
                sums[r] = MADD_ADD(sums[r], wv, _mm256_set1_epi32(pair));
            }
        }
    } else {
        for (int64_t p = 0; p < G / 4; p++) {
            if ((p & 3) == 0) _mm_prefetch((const char *)(u + 16 * p + 1024), _MM_HINT_T0);
            const __m128i v = _mm_loadu_si128((const __m128i *)(u + 16 * p));
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(v, nibble));
            const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nibble));
            for (int r = 0; r < R; r++) {
                int32_t p0, p1;
                memcpy(&p0, x + r * Kp + 4 * p, sizeof p0);
                memcpy(&p1, x + r * Kp + 4 * p + 2, sizeof p1);
                sums[r] = MADD_ADD(sums[r], lo, _mm256_set1_epi32(p0));
                sums[r] = MADD_ADD(sums[r], hi, _mm256_set1_epi32(p1));
            }
        }
    }
#endif
}

/* R rows (R <= 4) of the batch against one tile: res[r * TILE + c]. */
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *tile, int64_t NG, int64_t G,
                                                            const int bits, const int16_t *q, int64_t Kp,
                                                            const float *xs, const int R, float *res) {
    const int64_t gb = group_bytes(G, bits);
    __m256 f[4];
    for (int r = 0; r < R; r++) f[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        const uint8_t *grp = tile + g * gb;
        __m256i sums[4];
        group_sums(grp + 8 * TILE, G, bits, q + g * G, Kp, R, sums);
        const __m256 scale = _mm256_loadu_ps((const float *)grp), low = _mm256_loadu_ps((const float *)grp + TILE);
        for (int r = 0; r < R; r++) {
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, f[r]);
            f[r] = _mm256_fmadd_ps(low, _mm256_set1_ps(xs[r * NG + g]), f[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res + r * TILE, f[r]);
}

/* Batches of WIDE_ROWS rows and more take a second loop: per pair of tiles, every weight is
 * widened to int16 once into a buffer (Kp * 16 int16, in L1 or L2), then rows go through it two
 * at a time, a pair's four int32 and four float accumulators in registers. The narrow loop above
 * widens (and for 4 bits splits) the weights again for every 4 rows and keeps one tile: a 32- or
 * 64-sequence decode step took 5-11% longer with it (bench/decode_step.py); at 16 and 24 rows the
 * two measured the same. Per row the products and sums are the same, in the same order, so both
 * loops give the same bits. */
#define WIDE_ROWS 16

/* One group of one tile, widened: W[ws * s + 2 c + j] = weight of input 2 s + j of channel c (ws:
 * the int16 between pair-steps, 16 when the tile is alone, more when tiles are interleaved). */
static inline __attribute__((always_inline)) void widen_group(const uint8_t *u, int64_t G, const int bits, int16_t *W,
                                                              int64_t ws) {
    if (bits == 8) {
        for (int64_t s = 0; s < G / 2; s++)
            _mm256_store_si256((__m256i *)(W + ws * s), _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(u + 16 * s))));
        return;
    }
    const __m128i nibble = _mm_set1_epi8(0x0f);
    for (int64_t p = 0; p < G / 4; p++) { /* step p: low nibbles are pair-step 2p, high ones 2p + 1 */
        const __m128i v = _mm_loadu_si128((const __m128i *)(u + 16 * p));
        _mm256_store_si256((__m256i *)(W + ws * 2 * p), _mm256_cvtepu8_epi16(_mm_and_si128(v, nibble)));
        _mm256_store_si256((__m256i *)(W + ws * (2 * p + 1)),
                           _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nibble)));
    }
}

/* R rows (1 or 2) against T tiles (1 or 2) of widened weights W [T][NG][G / 2][16]; the tiles'
 * scales and minimums come from their packed groups (hdr[t] + g * gb). res[r * 2 TILE + t TILE + c]. */
static inline __attribute__((always_inline)) void wide_rows(const int16_t *W, int64_t NG, int64_t G, const int16_t *q,
                                                            int64_t Kp, const float *xs, const uint8_t *const *hdr,
                                                            int64_t gb, const int R, const int T, float *res) {
    const int64_t S = G / 2, tile_w = NG * S * 16;
    __m256 f[2][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) f[r][t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        const int16_t *w0 = W + g * S * 16, *w1 = w0 + tile_w, *x = q + g * G;
        __m256i a[2][2];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) a[r][t] = _mm256_setzero_si256();
        for (int64_t s = 0; s < S; s++) {
            const __m256i v0 = _mm256_load_si256((const __m256i *)(w0 + 16 * s));
            const __m256i v1 = T > 1 ? _mm256_load_si256((const __m256i *)(w1 + 16 * s)) : v0;
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, x + r * Kp + 2 * s, sizeof pair);
                const __m256i b = _mm256_set1_epi32(pair);
                a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(v0, b));
                if (T > 1) a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(v1, b));
            }
        }
        for (int t = 0; t < T; t++) {
            const float *h = (const float *)(hdr[t] + g * gb);
            const __m256 scale = _mm256_loadu_ps(h), low = _mm256_loadu_ps(h + TILE);
            for (int r = 0; r < R; r++) {
                f[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][t]), scale, f[r][t]);
                f[r][t] = _mm256_fmadd_ps(low, _mm256_set1_ps(xs[r * NG + g]), f[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) _mm256_storeu_ps(res + r * 2 * TILE + t * TILE, f[r][t]);
}

#ifdef RK_VNNI
/* With AVX-512 VNNI (vpdpwssd: the pairs' products added to int32 in one instruction) the wide
 * loop takes blocks of VNNI_TILES tiles (32 channels: two zmm registers per pair-step) and
 * VNNI_ROWS rows at a time, 12 int32 and 12 float accumulators among the 32 registers. Per row
 * the products, their int32 sums (exact in any order) and the float steps are those of the loops
 * above, in the same order: the same bits. */
#define VNNI_TILES 4
#define VNNI_ROWS 6

/* R rows (R <= VNNI_ROWS) against a widened block Wb [NG][G / 2][2][32] (pair-step s of tile t
 * at 64 s + 16 t) whose scales and minimums are sl [NG][2][32]; res[r * 32 + c]. */
static inline __attribute__((always_inline)) void vnni_rows(const int16_t *Wb, const float *sl, int64_t NG, int64_t G,
                                                            const int16_t *q, int64_t Kp, const float *xs, const int R,
                                                            float *res) {
    const int64_t S = G / 2;
    __m512 f[VNNI_ROWS][2];
    for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        const int16_t *w = Wb + g * S * 64, *x = q + g * G;
        __m512i a[VNNI_ROWS][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
        for (int64_t s = 0; s < S; s++) {
            const __m512i v0 = _mm512_load_si512(w + 64 * s), v1 = _mm512_load_si512(w + 64 * s + 32);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, x + r * Kp + 2 * s, sizeof pair);
                const __m512i b = _mm512_set1_epi32(pair);
                a[r][0] = _mm512_dpwssd_epi32(a[r][0], v0, b);
                a[r][1] = _mm512_dpwssd_epi32(a[r][1], v1, b);
            }
        }
        const float *h = sl + g * 64;
        const __m512 s0 = _mm512_load_ps(h), s1 = _mm512_load_ps(h + 16);
        const __m512 l0 = _mm512_load_ps(h + 32), l1 = _mm512_load_ps(h + 48);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(xs[r * NG + g]);
            f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][0]), s0, f[r][0]);
            f[r][0] = _mm512_fmadd_ps(l0, xv, f[r][0]);
            f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][1]), s1, f[r][1]);
            f[r][1] = _mm512_fmadd_ps(l1, xv, f[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(res + r * 32, f[r][0]);
        _mm512_storeu_ps(res + r * 32 + 16, f[r][1]);
    }
}

/* wide_linear on AVX-512 VNNI; 0 when its buffers cannot be had. */
static int vnni_linear(const int16_t *q, const float *dq, int64_t M, int64_t Kp, const uint8_t *w, int64_t G,
                       int bits, const float *bias, int64_t N, float *out, int64_t os, int accumulate,
                       const float *xsum) {
    const int64_t tiles = (N + TILE - 1) / TILE, NG = Kp / G, gb = group_bytes(G, bits), S = G / 2;
    const int64_t blocks = (tiles + VNNI_TILES - 1) / VNNI_TILES, wsize = Kp * 64, ssize = NG * 64;
    int16_t *wbuf = aligned_alloc(64, (size_t)(rk_threads() * wsize) * sizeof(int16_t));
    float *sbuf = aligned_alloc(64, (size_t)(rk_threads() * ssize) * sizeof(float));
    if (!wbuf || !sbuf) {
        free(wbuf);
        free(sbuf);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t b = VNNI_TILES * blk, T = tiles - b < VNNI_TILES ? tiles - b : VNNI_TILES, n = TILE * b;
        int16_t *Wb = wbuf + thread_index() * wsize;
        float *sl = sbuf + thread_index() * ssize;
        if (T < VNNI_TILES) { /* the last block's missing tiles: zero weights, never stored */
            memset(Wb, 0, (size_t)wsize * sizeof(int16_t));
            memset(sl, 0, (size_t)ssize * sizeof(float));
        }
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < NG; g++) {
                const uint8_t *grp = w + (b + t) * NG * gb + g * gb;
                int16_t *dst = Wb + g * S * 64 + t * 16;
                if (bits == 8) widen_group(grp + 8 * TILE, G, 8, dst, 64);
                else widen_group(grp + 8 * TILE, G, 4, dst, 64);
                memcpy(sl + g * 64 + t * TILE, grp, TILE * sizeof(float));
                memcpy(sl + g * 64 + 32 + t * TILE, grp + TILE * sizeof(float), TILE * sizeof(float));
            }
        float res[VNNI_ROWS * 32];
        for (int64_t m = 0; m < M;) {
            const int64_t rows = M - m < VNNI_ROWS ? M - m : VNNI_ROWS;
            const int16_t *x = q + m * Kp;
            const float *xs = xsum + m * NG;
            switch (rows) { /* constant rows: each compiles to its own unrolled loop */
            case 6: vnni_rows(Wb, sl, NG, G, x, Kp, xs, 6, res); break;
            case 5: vnni_rows(Wb, sl, NG, G, x, Kp, xs, 5, res); break;
            case 4: vnni_rows(Wb, sl, NG, G, x, Kp, xs, 4, res); break;
            case 3: vnni_rows(Wb, sl, NG, G, x, Kp, xs, 3, res); break;
            case 2: vnni_rows(Wb, sl, NG, G, x, Kp, xs, 2, res); break;
            default: vnni_rows(Wb, sl, NG, G, x, Kp, xs, 1, res);
            }
            store_rows(res, 32, m, rows, dq, n, T * TILE, N, bias, out, os, accumulate);
            m += rows;
        }
    }
    free(wbuf);
    free(sbuf);
    return 1;
}
#endif

/* rk_linear for M >= WIDE_ROWS (xsum filled); 0 when the widening buffer cannot be had. */
static int wide_linear(const int16_t *q, const float *dq, int64_t M, int64_t Kp, const uint8_t *w, int64_t G,
                       int bits, const float *bias, int64_t N, float *out, int64_t os, int accumulate,
                       const float *xsum) {
    const int64_t tiles = (N + TILE - 1) / TILE, NG = Kp / G, gb = group_bytes(G, bits), pairs = (tiles + 1) / 2;
#ifdef RK_VNNI
    if (vnni_linear(q, dq, M, Kp, w, G, bits, bias, N, out, os, accumulate, xsum)) return 1;
#endif
    const int64_t per_thread = 2 * Kp * TILE; /* int16 */
    int16_t *buffers = aligned_alloc(32, (size_t)(rk_threads() * per_thread) * sizeof(int16_t));
    if (!buffers) return 0;
#pragma omp parallel for schedule(static)
    for (int64_t pb = 0; pb < pairs; pb++) {
        const int64_t b = 2 * pb, T = b + 1 < tiles ? 2 : 1, n = TILE * b;
        int16_t *W = buffers + thread_index() * per_thread;
        const uint8_t *hdr[2] = {w + b * NG * gb, w + (b + 1) * NG * gb};
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < NG; g++) {
                const uint8_t *u = hdr[t] + g * gb + 8 * TILE;
                int16_t *dst = W + (t * NG + g) * (G / 2) * 16;
                if (bits == 8) widen_group(u, G, 8, dst, 16);
                else widen_group(u, G, 4, dst, 16);
            }
        float res[4 * TILE];
        for (int64_t m = 0; m < M;) {
            const int64_t rows = M - m >= 2 ? 2 : 1;
            const int16_t *x = q + m * Kp;
            const float *xs = xsum + m * NG;
            if (T == 2) {
                if (rows == 2) wide_rows(W, NG, G, x, Kp, xs, hdr, gb, 2, 2, res);
                else wide_rows(W, NG, G, x, Kp, xs, hdr, gb, 1, 2, res);
            } else {
                if (rows == 2) wide_rows(W, NG, G, x, Kp, xs, hdr, gb, 2, 1, res);
                else wide_rows(W, NG, G, x, Kp, xs, hdr, gb, 1, 1, res);
            }
            store_rows(res, 2 * TILE, m, rows, dq, n, T * TILE, N, bias, out, os, accumulate);
            m += rows;
        }
    }
    free(buffers);
    return 1;
}
#else
/* Weight k of channel c in a group's packed bytes u. */
static inline int32_t packed_weight(const uint8_t *u, int bits, int64_t k, int c) {
    if (bits == 8) return u[(k / 2) * 2 * TILE + c * 2 + k % 2];
    const uint8_t b = u[(k / 4) * 2 * TILE + c * 2 + k % 2];
    return k % 4 < 2 ? b & 0x0f : b >> 4;
}
#endif

/* out[m, n] (+)= dq[m] * sum_g (s[n, g] * sum_{k in g} q[m, k] u[n, k] + mn[n, g] * sum_{k in g} q[m, k])
 *               (+ bias[n]); only n < N is written. A weight is s * u + mn with u in 0..255 (8 bits)
 * or 0..15 (4 bits): asymmetric, so a GGUF Q4_1 block (d * q + m, q in 0..15) is exact at 4 bits
 * (s = d) and at 8 (s = d / 17). G <= 256 keeps a lane's int32 sum in range (G / 2 products of
 * 2 * 255 * 32767). xsum: M * Kp / G floats of scratch. */
void rk_linear(const int16_t *q, const float *dq, int64_t M, int64_t Kp, const uint8_t *w, int64_t G, int bits,
               const float *bias, int64_t N, float *out, int64_t os, int accumulate, float *xsum) {
    const int64_t tiles = (N + TILE - 1) / TILE, NG = Kp / G, gb = group_bytes(G, bits);
    for (int64_t i = 0; i < M * NG; i++) { /* each group's sum of the (quantized) inputs */
        const int16_t *x = q + (i / NG) * Kp + (i % NG) * G;
        int32_t sum = 0;
        for (int64_t k = 0; k < G; k++) sum += x[k];
        xsum[i] = (float)sum;
    }
#ifdef RK_AVX2
    if (M >= WIDE_ROWS && wide_linear(q, dq, M, Kp, w, G, bits, bias, N, out, os, accumulate, xsum)) return;
#endif
#pragma omp parallel for schedule(static) if (tiles * Kp * M > 32768)
    for (int64_t b = 0; b < tiles; b++) {
        const int64_t n = TILE * b;
        const uint8_t *tile = w + b * NG * gb;
        float res[4 * TILE];
        for (int64_t m = 0; m < M;) {
            const int64_t rows = M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
            const int16_t *x = q + m * Kp;
            const float *xs = xsum + m * NG;
#ifdef RK_AVX2
            /* constant bits and rows: each combination compiles to its own unrolled loop */
            if (bits == 8) {
                if (rows == 4) tile_rows(tile, NG, G, 8, x, Kp, xs, 4, res);
                else if (rows == 2) tile_rows(tile, NG, G, 8, x, Kp, xs, 2, res);
                else tile_rows(tile, NG, G, 8, x, Kp, xs, 1, res);
            } else {
                if (rows == 4) tile_rows(tile, NG, G, 4, x, Kp, xs, 4, res);
                else if (rows == 2) tile_rows(tile, NG, G, 4, x, Kp, xs, 2, res);
                else tile_rows(tile, NG, G, 4, x, Kp, xs, 1, res);
            }
#else
            for (int64_t r = 0; r < rows; r++) {
                for (int c = 0; c < TILE; c++) res[r * TILE + c] = 0.f;
                for (int64_t g = 0; g < NG; g++) {
                    const uint8_t *grp = tile + g * gb, *u = grp + 8 * TILE;
                    const float *hdr = (const float *)grp;
                    for (int c = 0; c < TILE; c++) {
                        int32_t sum = 0;
                        for (int64_t k = 0; k < G; k++)
                            sum += (int32_t)x[r * Kp + g * G + k] * packed_weight(u, bits, k, c);
                        res[r * TILE + c] += (float)sum * hdr[c] + hdr[TILE + c] * xs[r * NG + g];
                    }
                }
            }
#endif
            store_rows(res, TILE, m, rows, dq, n, TILE, N, bias, out, os, accumulate);
            m += rows;
        }
    }
}

/* Qwen3's and Gemma 3's norms of each query and key head (before rotary), in place on qkv
 * [M, (H + 2 KVH) D] (row stride qs): RMSNorm over each head's D values, times the query or the
 * key factors. */
static void head_norms(float *qkv, int64_t M, int64_t qs, int64_t H, int64_t KVH, int64_t D, const float *qn,
                       const float *kn, float eps) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x = qkv + m * qs + h * D;
            const float *w = h < H ? qn : kn;
            const float inv = rms_inv(x, D, eps);
            for (int64_t d = 0; d < D; d++) x[d] = w[d] * (x[d] * inv);
        }
}

/* One part of a LoRA adapter of one projection (lora.py): out[first + j] += sum_r bt[r, j] (a[r] . x),
 * the scale folded into bt. a: [rank, K], bt: [rank, span] (B transposed, so that each r adds a
 * contiguous row), float32; a NULL: no such part. */
typedef struct {
    const float *a, *bt;
    int64_t rank, first, span;
} rk_lora;

#define RK_LORA_PARTS 3 /* per projection: q, k and v of the fused qkv (or gate and up), else one */
#define RK_LORA_RANK 1024 /* the most rank one part may have here (cpu_decode.py checks) */
int rk_lora_parts(void) { return RK_LORA_PARTS; }
int rk_lora_rank(void) { return RK_LORA_RANK; }

/* Adds each adapted row's low-rank products for projection `which` (0 qkv, 1 o, 2 gate_up,
 * 3 down) of `layer`, from the quantized input (q, dq: the rows rk_linear just read) into out
 * [M, os]. row_adapter[m]: the row's adapter (0, or above `adapters`: left as the base model's);
 * table: per adapter, layer and projection, RK_LORA_PARTS parts. scratch: K floats for each of the
 * rk_threads() threads. Each row is computed alone, the same way whatever else the step holds. */
static void lora_add(const rk_lora *table, int64_t adapters, int64_t layers, int64_t layer, int which,
                     const int64_t *row_adapter, const int16_t *q, const float *dq, int64_t M, int64_t Kp, int64_t K,
                     float *out, int64_t os, float *scratch) {
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t m = 0; m < M; m++) {
        const int64_t ad = row_adapter[m];
        if (ad <= 0 || ad > adapters) continue;
        const rk_lora *parts = table + (((ad - 1) * layers + layer) * 4 + which) * RK_LORA_PARTS;
        float *x = scratch + thread_index() * K; /* the row as rk_linear saw it (times dq[m], below) */
        for (int64_t k = 0; k < K; k++) x[k] = (float)q[m * Kp + k];
        for (int p = 0; p < RK_LORA_PARTS; p++) {
            const rk_lora *l = parts + p;
            if (!l->a) continue;
            float t[RK_LORA_RANK];
            for (int64_t r = 0; r < l->rank; r++) {
                const float *ar = l->a + r * K;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t k = 0; k < K; k++) sum += ar[k] * x[k];
                t[r] = sum * dq[m];
            }
            float *y = out + m * os + l->first;
            for (int64_t r = 0; r < l->rank; r++) {
                const float *br = l->bt + r * l->span, tr = t[r];
#pragma omp simd
                for (int64_t j = 0; j < l->span; j++) y[j] += tr * br[j];
            }
        }
    }
}

/* One expert of a mixture: its packed gate_up and down, their biases (gpt-oss; NULL: none). */
typedef struct {
    const uint8_t *gate_up, *down;
    const float *gate_up_bias, *down_bias;
} rk_expert;

/* A whole decode step, for the weights of one model (see cpu_decode.py, which fills these). */
typedef struct {
    /* Every norm's factors are float32 per dimension: the weight, or Gemma's 1 + weight. The
     * blocks' input norms (NULL: none, OLMo's) */
    const float *ln1, *ln2;
    float eps1, eps2;
    const float *ln1_bias, *ln2_bias; /* the LayerNorms' (rk_model.centered); NULL: none */
    const uint8_t *qkv, *o, *gate_up, *down; /* packed weights */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* NULL: none */
    int64_t qkv_kp, o_kp, gate_up_kp, down_kp; /* padded input sizes */
    void *k_cache, *v_cache; /* of the model's kv_kind */
    int64_t window; /* the layer's sliding window; 0: it attends to every position */
    /* Qwen3's and Gemma 3's [head_dim] per query / key head, or with qk_norm_whole OLMo's over the
     * whole query [heads head_dim] and key [kv_heads head_dim] projection; NULL: none */
    const float *q_norm, *k_norm;
    float qk_eps;
    int qk_norm_whole;
    /* the layer's rotary tables (Gemma 3's sliding layers have their own); NULL: none (NoPE) */
    const float *cos, *sin;
    /* Gemma 2/3: norms of the attention's and the MLP's outputs before their residual adds; NULL: none */
    const float *attn_out_norm, *mlp_out_norm;
    float out_eps;
    const float *sinks; /* gpt-oss: each query head's sink logit [heads]; NULL: none */
    /* A mixture of experts in the MLP's place (experts != NULL; gate_up and down unused): the router's
     * float32 [num_experts, hidden] weights (and gpt-oss's bias); each expert's packed gate_up
     * [2 expert_inter] and down [hidden]; Qwen2-MoE's shared expert (NULL: none), which every token
     * runs through, scaled by sigmoid(shared_gate . x) (shared_gate NULL: added as it is, GLM-4.5's,
     * dots.llm1's and ERNIE 4.5's shared experts). */
    const float *router, *router_bias;
    const rk_expert *experts, *shared;
    int64_t num_experts, top_k, expert_inter, expert_gate_up_kp, expert_down_kp;
    /* How the top_k weights come: 0 softmax over every expert, then the top k; 1 the same,
     * renormalised to sum to 1 (Mixtral, Qwen's norm_topk_prob); 2 the top k logits softmaxed
     * among themselves (gpt-oss). */
    int routing;
    float clamp_alpha, clamp_limit; /* gpt-oss's experts' clamped SwiGLU (clamp_limit > 0) */
    const float *shared_gate;
    int64_t shared_inter, shared_gate_up_kp, shared_down_kp;
    /* DeepSeek-V3's routing (GLM-4.5, dots.llm1, MiniMax-M2; ERNIE 4.5 with softmax scores), with
     * routing 0 or 1: sigmoid scores (0: the softmax); choice_bias [num_experts] added to the scores
     * to choose the experts, whose weights are the scores themselves (NULL: none); with n_group > 1,
     * chosen among the topk_group groups whose two best biased scores sum highest; the weights
     * times routed_scale (1: none). */
    int sigmoid;
    const float *choice_bias;
    int64_t n_group, topk_group;
    float routed_scale;
    /* LFM2: a short convolution in attention's place (conv_taps != NULL): qkv is its in_proj (B, C
     * and x, hidden each), o its out_proj, k_cache holds each token's B * x ([slots, hidden]);
     * conv_taps [conv_kernel, hidden] (tap j reads position p - conv_kernel + 1 + j), conv_bias
     * [hidden] (NULL: none). */
    const float *conv_taps, *conv_bias;
    int64_t conv_kernel;
    int qk_norm_after_rotary; /* Hunyuan: q_norm and k_norm on the rotated heads (0: before the rotary) */
} rk_layer;

typedef struct {
    int64_t num_layers, hidden, inter, heads, kv_heads, head_dim, group, vocab, block_size;
    float scale, final_eps;
    float softcap; /* the attention scores' tanh cap (Gemma 2); 0: none */
    float residual_scale; /* Granite: each block's output times this before its residual add; 1: none */
    const float *q_scales; /* Ministral 3: [max positions] factors on the rotated queries; NULL: none */
    /* the MLP's activation: gated (gate_up [gate | up]) 0 SiLU (SwiGLU), 1 GELU's tanh form (GeGLU);
     * ungated (gate_up holds up alone, inter wide) 2 GELU's tanh form, 3 the exact GELU, 4 ReLU,
     * 5 squared ReLU */
    int act;
    const rk_layer *layers;
    const float *final_norm;
    const uint8_t *lm_head;
    int64_t lm_head_kp;
    int bits, lm_head_bits; /* of the layers' projections, of the LM head: 8 or 4 */
    int kv_kind; /* the KV cache's element type: RK_F32, RK_F16 or RK_BF16 */
    const rk_lora *lora; /* LoRA adapters: [adapter - 1][layer][projection][RK_LORA_PARTS]; NULL: none */
    int64_t num_adapters; /* entries of lora: a row whose adapter is above it is left as the base model's */
    int head_gates; /* LFM3: a gate a query head after q, k and v in qkv's rows, each head's output times
                     * its sigmoid; 0: none */
    /* The LayerNorm families (and Cohere): every norm a LayerNorm (centred; the layers' ln1_bias and
     * ln2_bias and final_norm_bias, NULL: none); 0: RMSNorms */
    int centered;
    const float *final_norm_bias;
    const float *lm_head_bias; /* Phi's, GPT-J's; NULL: none */
    /* 0: the MLP after the attention; 1: both from the layer's input, the MLP reading the attention's
     * normed input (Cohere, Phi, GPT-J, Falcon 7B), 2: its own norm ln2 of it (GPT-NeoX, Falcon 40B) */
    int parallel;
    float clip_qkv; /* OLMo 1: q, k and v clamped to within it as they leave their projection; 0: none */
    /* BLOOM, MPT, Falcon-RW: each query head's ALiBi slope [heads] (its scaled scores get slope times
     * the key's position less the query's); NULL: none */
    const float *alibi;
} rk_model;

/* gpt-oss's experts' activation for rows [gate (I) | up (I)], quantized: the gate clamped to at most
 * limit, up to within it, (up + 1) * gate * sigmoid(alpha * gate), in moe.py's order. tmp: I floats. */
static void clamped_swiglu_quantize(const float *gu, int64_t M, int64_t I, int64_t gs, float alpha, float limit,
                                    float *tmp, int64_t Kp, int16_t *q, float *dq) {
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * gs, *u = g + I;
        for (int64_t i = 0; i < I; i++) {
            const float gate = g[i] > limit ? limit : g[i]; /* a NaN stays NaN, as torch.clamp keeps it */
            const float up = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
            tmp[i] = (up + 1.f) * (gate * (1.f / (1.f + expf(-(gate * alpha)))));
        }
        dq[m] = quantize_row(tmp, I, Kp, q + m * Kp);
    }
}

/* One expert (a gated MLP) over M rows already quantized for its gate_up (q, dq): gate_up ->
 * activation -> quantize -> down, written to out [M, H] (overwriting). gu: M * 2I floats, tmp: I
 * floats, q2 and dq2: M rows of down_kp, scratch of their own. */
static void expert_mlp(const rk_model *md, const rk_layer *l, const rk_expert *ex, const int16_t *q, const float *dq,
                       int64_t M, int64_t gate_up_kp, int64_t down_kp, int64_t I, float *gu, float *tmp, int16_t *q2,
                       float *dq2, float *out, float *xsum) {
    rk_linear(q, dq, M, gate_up_kp, ex->gate_up, md->group, md->bits, ex->gate_up_bias, 2 * I, gu, 2 * I, 0, xsum);
    if (l->clamp_limit > 0.f)
        clamped_swiglu_quantize(gu, M, I, 2 * I, l->clamp_alpha, l->clamp_limit, tmp, down_kp, q2, dq2);
    else
        (md->act == 1 ? rk_gelu_tanh_mul_quantize : rk_silu_mul_quantize)(gu, M, I, 2 * I, tmp, down_kp, q2, dq2);
    rk_linear(q2, dq2, M, down_kp, ex->down, md->group, md->bits, ex->down_bias, md->hidden, out, md->hidden, 0, xsum);
}

/* The biased scores c [E] of the experts outside the topk_group best groups (each scored by the
 * sum of its two best) set to -inf; the lower index first among equal groups. */
static void drop_groups(const rk_layer *l, float *c) {
    const int64_t G = l->n_group, S = l->num_experts / G;
    float best[G];
    int kept[G];
    for (int64_t g = 0; g < G; g++) {
        float a = -INFINITY, b = -INFINITY; /* the group's best and second best */
        for (int64_t e = g * S; e < (g + 1) * S; e++) {
            if (c[e] > a) b = a, a = c[e];
            else if (c[e] > b) b = c[e];
        }
        best[g] = a + b;
        kept[g] = 0;
    }
    for (int64_t k = 0; k < l->topk_group; k++) {
        int64_t top = -1;
        for (int64_t g = 0; g < G; g++)
            if (!kept[g] && (top < 0 || best[g] > best[top])) top = g;
        kept[top] = 1;
    }
    for (int64_t g = 0; g < G; g++)
        if (!kept[g])
            for (int64_t e = g * S; e < (g + 1) * S; e++) c[e] = -INFINITY;
}

/* Row m's top_k experts into chosen[] (best first; the lower index first among exact equals,
 * which torch.topk does not promise: an exact tie may pick another of the equal experts than the
 * torch path) and their weights (l->routing, l->routed_scale) from its router logits p [E]
 * (overwritten with the scores). c: E floats of scratch (the biased scores). */
static void route(const rk_layer *l, float *p, float *c, int64_t *chosen, float *weights) {
    const int64_t E = l->num_experts, K = l->top_k;
    if (l->routing != 2 && l->sigmoid) {
        for (int64_t e = 0; e < E; e++) p[e] = 1.f / (1.f + expf(-p[e]));
    } else if (l->routing != 2) { /* softmax over every expert first */
        float top = -INFINITY, total = 0.f;
        for (int64_t e = 0; e < E; e++) top = p[e] > top ? p[e] : top;
        for (int64_t e = 0; e < E; e++) total += (p[e] = expf(p[e] - top));
        for (int64_t e = 0; e < E; e++) p[e] /= total;
    }
    const float *by = p; /* what the experts are chosen by */
    if (l->choice_bias) {
        for (int64_t e = 0; e < E; e++) c[e] = p[e] + l->choice_bias[e];
        if (l->n_group > 1) drop_groups(l, c);
        by = c;
    }
    for (int64_t s = 0; s < K; s++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t t = 0; t < s; t++) taken |= chosen[t] == e;
            if (!taken && (best < 0 || by[e] > by[best])) best = e;
        }
        chosen[s] = best;
        weights[s] = p[best];
    }
    if (l->routing == 1) {
        float sum = 0.f;
        for (int64_t s = 0; s < K; s++) sum += weights[s];
        for (int64_t s = 0; s < K; s++) weights[s] /= sum;
    } else if (l->routing == 2) { /* the chosen logits softmaxed among themselves (weights[0] the largest) */
        const float top = weights[0];
        float total = 0.f;
        for (int64_t s = 0; s < K; s++) total += (weights[s] = expf(weights[s] - top));
        for (int64_t s = 0; s < K; s++) weights[s] /= total;
    }
    if (l->routed_scale != 1.f)
        for (int64_t s = 0; s < K; s++) weights[s] *= l->routed_scale;
}

/* A mixture of experts' block over the residual x [M, H] (its output added to x), as
 * backends/torch/moe.py computes it: RMSNorm; the router's logits in float32 from the normalised
 * rows (unquantized: a rounding there changes which experts a row reaches), plus gpt-oss's bias;
 * the top_k experts and their weights (route); each expert's matmuls over exactly the rows
 * routed to it; each (row, slot) output times its weight kept apart, then the slots summed in
 * order, plus the shared expert, times Granite's residual_scale. Returns 0 when its scratch
 * cannot be allocated (nothing changed then). */
static int moe_block(const rk_model *md, const rk_layer *l, int64_t M, float *x, float *xsum) {
    const int64_t H = md->hidden, E = l->num_experts, K = l->top_k, I = l->expert_inter, SI = l->shared_inter;
    const int64_t kp = l->expert_gate_up_kp > l->shared_gate_up_kp ? l->expert_gate_up_kp : l->shared_gate_up_kp;
    const int64_t kp2 = l->expert_down_kp > l->shared_down_kp ? l->expert_down_kp : l->shared_down_kp;
    const int64_t II = I > SI ? I : SI;
    float *normed = malloc((size_t)(M * H) * sizeof(float)), *probs = malloc((size_t)(M * E) * sizeof(float));
    float *choice = malloc((size_t)(M * E) * sizeof(float));
    float *weights = malloc((size_t)(M * K) * sizeof(float)), *slots = malloc((size_t)(M * K * H) * sizeof(float));
    float *gu = malloc((size_t)(M * 2 * II) * sizeof(float)), *tmp = malloc((size_t)II * sizeof(float));
    float *eo = malloc((size_t)(M * H) * sizeof(float)), *dqa = malloc((size_t)M * sizeof(float));
    float *dqe = malloc((size_t)M * sizeof(float)), *dq2 = malloc((size_t)M * sizeof(float));
    int64_t *chosen = malloc((size_t)(M * K) * sizeof(int64_t)), *pairs = malloc((size_t)(M * K) * sizeof(int64_t));
    int16_t *qa = malloc((size_t)(M * kp) * sizeof(int16_t)), *qe = malloc((size_t)(M * kp) * sizeof(int16_t));
    int16_t *q2 = malloc((size_t)(M * kp2) * sizeof(int16_t));
    int ok = normed && probs && choice && weights && slots && gu && tmp && eo && dqa && dqe && dq2 && chosen && pairs && qa &&
             qe && q2;
    if (ok) {
        for (int64_t m = 0; m < M; m++) rmsnorm_row(x + m * H, H, l->ln2, l->eps2, normed + m * H);
        rk_quantize_rows(normed, M, H, H, kp, qa, dqa); /* every expert's rows (kp: the widest gate_up) */
#pragma omp parallel for schedule(static) if (M * E * H > 65536)
        for (int64_t m = 0; m < M; m++) {
            float *p = probs + m * E;
            for (int64_t e = 0; e < E; e++) {
                const float *w = l->router + e * H, *n = normed + m * H;
                float sum = 0.f;
                for (int64_t k = 0; k < H; k++) sum += n[k] * w[k];
                p[e] = l->router_bias ? sum + l->router_bias[e] : sum;
            }
            route(l, p, choice + m * E, chosen + m * K, weights + m * K);
        }
        for (int64_t e = 0; e < E; e++) {
            int64_t count = 0;
            for (int64_t j = 0; j < M * K; j++)
                if (chosen[j] == e) pairs[count++] = j;
            if (!count) continue;
            for (int64_t j = 0; j < count; j++) { /* the rows routed here, as the expert's own batch */
                const int64_t m = pairs[j] / K;
                memcpy(qe + j * l->expert_gate_up_kp, qa + m * kp, (size_t)l->expert_gate_up_kp * sizeof(int16_t));
                dqe[j] = dqa[m];
            }
            expert_mlp(md, l, l->experts + e, qe, dqe, count, l->expert_gate_up_kp, l->expert_down_kp, I, gu, tmp, q2,
                       dq2, eo, xsum);
            for (int64_t j = 0; j < count; j++) {
                const float w = weights[pairs[j]], *src = eo + j * H;
                float *dst = slots + pairs[j] * H;
                for (int64_t k = 0; k < H; k++) dst[k] = src[k] * w;
            }
        }
        if (l->shared) {
            if (l->shared_gate_up_kp != kp)
                for (int64_t m = 0; m < M; m++)
                    memcpy(qe + m * l->shared_gate_up_kp, qa + m * kp, (size_t)l->shared_gate_up_kp * sizeof(int16_t));
            expert_mlp(md, l, l->shared, l->shared_gate_up_kp != kp ? qe : qa, dqa, M, l->shared_gate_up_kp,
                       l->shared_down_kp, SI, gu, tmp, q2, dq2, eo, xsum);
        }
        for (int64_t m = 0; m < M; m++) {
            float g = 1.f; /* an ungated shared expert's factor */
            if (l->shared_gate) {
                const float *n = normed + m * H;
                float sum = 0.f;
                for (int64_t k = 0; k < H; k++) sum += n[k] * l->shared_gate[k];
                g = 1.f / (1.f + expf(-sum));
            }
            float *r = x + m * H;
            for (int64_t k = 0; k < H; k++) {
                float y = slots[(m * K) * H + k];
                for (int64_t s = 1; s < K; s++) y += slots[(m * K + s) * H + k];
                if (l->shared) y += g * eo[m * H + k];
                r[k] += y * md->residual_scale; /* Granite-MoE's multiplier; times 1 is exact for the others */
            }
        }
    }
    free(normed), free(probs), free(choice), free(weights), free(slots), free(gu), free(tmp), free(eo), free(dqa), free(dqe);
    free(dq2), free(chosen), free(pairs), free(qa), free(qe), free(q2);
    return ok;
}

/* LFM2's short convolution over a step's rows, as conv.py's ShortConv computes it: bcx [M, 3 H] the
 * in_proj's B, C and x; each row's B * x written to its slot of the layer's cache first (a prompt's
 * rows read the rows before them), then y [M, H] = C * (sum over taps j of taps[j] * the input at
 * position p - kernel + 1 + j, those before the sequence began left out, + bias), in float32. */
static void short_conv(const float *bcx, int64_t M, int64_t H, const rk_layer *l, const int64_t *pos,
                       const int64_t *slot, const int64_t *table, int64_t tw, const int64_t *tab_of, int64_t bs,
                       int kind, float *tmp, float *y) {
    const int64_t K = l->conv_kernel;
    for (int64_t m = 0; m < M; m++) {
        const float *b = bcx + m * 3 * H, *x = b + 2 * H;
        for (int64_t c = 0; c < H; c++) tmp[c] = b[c] * x[c];
        kv_store(l->k_cache, slot[m] * H, tmp, H, kind);
    }
    for (int64_t m = 0; m < M; m++) {
        float *out = y + m * H;
        for (int64_t c = 0; c < H; c++) out[c] = 0.f;
        for (int64_t j = 0; j < K; j++) {
            const int64_t p = pos[m] - K + 1 + j;
            if (p < 0) continue;
            const int64_t s = table[tab_of[m] * tw + p / bs] * bs + p % bs;
            const float *taps = l->conv_taps + j * H;
            for (int64_t c = 0; c < H; c++) out[c] += kv_load(l->k_cache, s * H + c, kind) * taps[c];
        }
        const float *cgate = bcx + m * 3 * H + H;
        for (int64_t c = 0; c < H; c++) out[c] = cgate[c] * (l->conv_bias ? out[c] + l->conv_bias[c] : out[c]);
    }
}

/* LFM3: each row's heads of attn [M, heads D] times the sigmoids of their gates (gate [heads], row stride gs). */
static void head_gates(const float *gate, int64_t M, int64_t gs, int64_t heads, int64_t D, float *attn) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < heads; h++) {
            const float g = 1.f / (1.f + expf(-gate[m * gs + h]));
            float *out = attn + (m * heads + h) * D;
            for (int64_t d = 0; d < D; d++) out[d] *= g;
        }
}

/* Rows x [M, H] quantized, normalised first by ln (NULL: as they are, OLMo 2's blocks): the
 * model's RMSNorm, or its LayerNorm with bias (md->centered). */
static void input_quantize(const rk_model *md, const float *x, int64_t M, int64_t H, const float *ln, const float *bias,
                           float eps, float *tmp, int64_t Kp, int16_t *q, float *dq) {
    if (ln && md->centered)
        for (int64_t m = 0; m < M; m++) {
            layernorm_row(x + m * H, H, ln, bias, eps, tmp);
            dq[m] = quantize_row(tmp, H, Kp, q + m * Kp);
        }
    else if (ln)
        rk_rmsnorm_quantize(x, M, H, H, ln, eps, tmp, Kp, q, dq);
    else
        rk_quantize_rows(x, M, H, H, Kp, q, dq);
}

/* An ungated MLP's activation of rows h [M, I], in place, then quantized: act 2 GELU's tanh form
 * (as g / (1 + e^(-2u)), gated_mul_quantize's identity), 3 the exact GELU, 4 ReLU, 5 squared ReLU
 * (rk_model.act). Rows split across threads. */
static void ungated_quantize(float *h, int64_t M, int64_t I, int act, int64_t Kp, int16_t *q, float *dq) {
    const float c = 0.7978845608028654f, c3 = 0.7978845608028654f * 0.044715f, r2 = 0.7071067811865476f;
#pragma omp parallel for schedule(static) if (M * I >= 16384)
    for (int64_t m = 0; m < M; m++) {
        float *g = h + m * I;
        int64_t i = 0;
        if (act == 2) {
#ifdef RK_AVX2
            const __m256 one = _mm256_set1_ps(1.f), m2c = _mm256_set1_ps(-2.f * c), m2c3 = _mm256_set1_ps(-2.f * c3);
            for (; i + 8 <= I; i += 8) {
                const __m256 gv = _mm256_loadu_ps(g + i);
                const __m256 arg = _mm256_mul_ps(gv, _mm256_add_ps(m2c, _mm256_mul_ps(m2c3, _mm256_mul_ps(gv, gv))));
                _mm256_storeu_ps(g + i, _mm256_div_ps(gv, _mm256_add_ps(one, exp8(arg))));
            }
#endif
            for (; i < I; i++) g[i] = g[i] / (1.f + expf(g[i] * (-2.f * c + -2.f * c3 * (g[i] * g[i]))));
        } else if (act == 3)
            for (; i < I; i++) g[i] = 0.5f * g[i] * (1.f + erff(g[i] * r2));
        else if (act == 4)
            for (; i < I; i++) g[i] = g[i] > 0.f ? g[i] : 0.f;
        else
            for (; i < I; i++) g[i] = g[i] > 0.f ? g[i] * g[i] : 0.f;
        dq[m] = quantize_row(g, I, Kp, q + m * Kp);
    }
}

/* One engine step: decoding sequences and prompt chunks alike, a row per new token.
 *
 * x [M, hidden]: the new tokens' embeddings in, the residual stream throughout. Positions, slots,
 * block tables, each row's table row and lengths as attention() takes them. Only the S rows listed
 * in out_rows (ascending) reach the final norm and the LM head: a decoding sequence's row and the
 * last row of a prompt's final chunk; the rows of other chunks only fill the cache. Scratch:
 * q [M, max kp] int16, dq [M], tmp [max(hidden, inter)], qkv, attn, gate_up (one row each per
 * token; with LFM2's convolutions qkv's rows at least 3 hidden, attn's at least hidden),
 * xsum [M max kp / group] (an ungated MLP's activation is computed in gate_up's rows; parallel
 * blocks allocate their MLP input's quantized rows here). row_adapter [M]: each row's LoRA adapter
 * (0: none), or NULL when no row has one. Out: logits [S, vocab]. Returns 0 when the attention's,
 * the adapters', the output norms', the parallel blocks' or a mixture of experts' scratch cannot
 * be allocated: the step is then void
 * (layers before a mixture of experts may have written their keys and values, which running the
 * step again writes again). */
int rk_decode_step(const rk_model *md, int64_t M, float *x, const int64_t *pos, const int64_t *slot,
                   const int64_t *table, int64_t tw, const int64_t *tab_of, const int64_t *len, int64_t max_len,
                   const int64_t *out_rows, int64_t S, int16_t *q, float *dq, float *tmp, float *qkv, float *attn,
                   float *gate_up, float *xsum, float *logits, const int64_t *row_adapter) {
    const int64_t H = md->hidden, I = md->inter, D = md->head_dim;
    const int64_t gates = md->head_gates ? md->heads : 0;
    const int64_t qkv_size = (md->heads + 2 * md->kv_heads) * D + gates, attn_size = md->heads * D;
    float *scores = malloc((size_t)(rk_threads() * RK_SHARE * max_len) * sizeof(float));
    if (!scores) return 0;
    const int lora = md->lora && row_adapter;
    const int64_t L = md->num_layers, K_max = H > I ? (H > attn_size ? H : attn_size) : (I > attn_size ? I : attn_size);
    float *lx = lora ? malloc((size_t)(rk_threads() * K_max) * sizeof(float)) : NULL;
    /* Gemma 2/3: a block's output is normalised before its add, Granite's scaled, so it lands
     * here first. */
    const int sandwich = md->layers[0].attn_out_norm != NULL, scaled = md->residual_scale != 1.f;
    float *branch = sandwich || scaled ? malloc((size_t)(M * H) * sizeof(float)) : NULL;
    /* Parallel blocks: the MLP's input, quantized before the attention adds to the residual. */
    const int64_t mlp_kp = md->layers[0].gate_up_kp;
    int16_t *pq = md->parallel ? malloc((size_t)(M * mlp_kp) * sizeof(int16_t)) : NULL;
    float *pdq = md->parallel ? malloc((size_t)M * sizeof(float)) : NULL;
    if ((lora && !lx) || ((sandwich || scaled) && !branch) || (md->parallel && (!pq || !pdq))) {
        free(scores);
        free(lx);
        free(branch);
        free(pq);
        free(pdq);
        return 0;
    }
    const int ungated = md->act >= 2, up_size = ungated ? I : 2 * I;
    /* Where o_proj and down_proj write, and whether they add to it. */
    float *out = branch ? branch : x;
    const int add = !branch;
    for (int64_t i = 0; i < md->num_layers; i++) {
        const rk_layer *l = md->layers + i;
        input_quantize(md, x, M, H, l->ln1, l->ln1_bias, l->eps1, tmp, l->qkv_kp, q, dq);
        if (md->parallel == 1) /* the same normed input as the attention's */
            input_quantize(md, x, M, H, l->ln1, l->ln1_bias, l->eps1, tmp, mlp_kp, pq, pdq);
        else if (md->parallel == 2) /* its own norm of the layer's input */
            input_quantize(md, x, M, H, l->ln2, l->ln2_bias, l->eps2, tmp, mlp_kp, pq, pdq);
        if (l->conv_taps) { /* LFM2: a short convolution, then the MLP below (no adapters: lora.py refuses them) */
            rk_linear(q, dq, M, l->qkv_kp, l->qkv, md->group, md->bits, l->qkv_bias, 3 * H, qkv, 3 * H, 0, xsum);
            short_conv(qkv, M, H, l, pos, slot, table, tw, tab_of, md->block_size, md->kv_kind, tmp, attn);
            rk_quantize_rows(attn, M, H, H, l->o_kp, q, dq);
            rk_linear(q, dq, M, l->o_kp, l->o, md->group, md->bits, l->o_bias, H, out, H, add, xsum);
        } else {
            rk_linear(q, dq, M, l->qkv_kp, l->qkv, md->group, md->bits, l->qkv_bias, qkv_size, qkv, qkv_size, 0, xsum);
            if (lora)
                lora_add(md->lora, md->num_adapters, L, i, 0, row_adapter, q, dq, M, l->qkv_kp, H, qkv, qkv_size, lx);
            if (md->clip_qkv > 0.f) { /* OLMo 1 (NaN kept, as torch's clamp keeps it) */
                const float lim = md->clip_qkv;
                for (int64_t j = 0; j < M * qkv_size; j++) qkv[j] = qkv[j] > lim ? lim : qkv[j] < -lim ? -lim : qkv[j];
            }
            if (l->q_norm && l->qk_norm_whole) { /* OLMo: the query and the key projections as one vector each */
                head_norms(qkv, M, qkv_size, 1, 0, md->heads * D, l->q_norm, NULL, l->qk_eps);
                head_norms(qkv + md->heads * D, M, qkv_size, 1, 0, md->kv_heads * D, l->k_norm, NULL, l->qk_eps);
            } else if (l->q_norm && l->qk_norm_after_rotary) { /* Hunyuan: rotated here, attention() rotates no more */
                for (int64_t m = 0; l->cos && m < M; m++)
                    rotate(qkv + m * qkv_size, md->heads + md->kv_heads, D, l->cos + pos[m] * D, l->sin + pos[m] * D);
                head_norms(qkv, M, qkv_size, md->heads, md->kv_heads, D, l->q_norm, l->k_norm, l->qk_eps);
            } else if (l->q_norm)
                head_norms(qkv, M, qkv_size, md->heads, md->kv_heads, D, l->q_norm, l->k_norm, l->qk_eps);
            const int rotated = l->q_norm && l->qk_norm_after_rotary;
            attention(qkv, M, qkv_size, md->heads, md->kv_heads, D, pos, rotated ? NULL : l->cos, l->sin, l->k_cache,
                      l->v_cache, slot,
                      table, tw, tab_of, len, md->block_size, l->window, md->scale, md->softcap, l->sinks, md->alibi, md->q_scales,
                      max_len, md->kv_kind, scores, attn);
            if (gates) head_gates(qkv + qkv_size - gates, M, qkv_size, md->heads, D, attn);
            rk_quantize_rows(attn, M, attn_size, attn_size, l->o_kp, q, dq);
            rk_linear(q, dq, M, l->o_kp, l->o, md->group, md->bits, l->o_bias, H, out, H, add, xsum);
            if (lora)
                lora_add(md->lora, md->num_adapters, L, i, 1, row_adapter, q, dq, M, l->o_kp, attn_size, out, H, lx);
        }
        if (sandwich) rmsnorm_add(branch, M, H, l->attn_out_norm, l->out_eps, x);
        else if (scaled) scaled_add(branch, M, H, md->residual_scale, x);
        /* no adapters (lora.py refuses experts') nor output norms (cpu_decode.py) here */
        if (l->experts) {
            if (!moe_block(md, l, M, x, xsum)) {
                free(scores);
                free(lx);
                free(branch);
                free(pq);
                free(pdq);
                return 0;
            }
            continue;
        }
        const int16_t *mq = md->parallel ? pq : q;
        const float *mdq = md->parallel ? pdq : dq;
        if (!md->parallel) input_quantize(md, x, M, H, l->ln2, l->ln2_bias, l->eps2, tmp, l->gate_up_kp, q, dq);
        rk_linear(mq, mdq, M, l->gate_up_kp, l->gate_up, md->group, md->bits, l->gate_up_bias, up_size, gate_up, up_size,
                  0, xsum);
        if (lora) lora_add(md->lora, md->num_adapters, L, i, 2, row_adapter, mq, mdq, M, l->gate_up_kp, H, gate_up, up_size, lx);
        if (ungated)
            ungated_quantize(gate_up, M, I, md->act, l->down_kp, q, dq);
        else
            (md->act ? rk_gelu_tanh_mul_quantize : rk_silu_mul_quantize)(gate_up, M, I, 2 * I, tmp, l->down_kp, q, dq);
        rk_linear(q, dq, M, l->down_kp, l->down, md->group, md->bits, l->down_bias, H, out, H, add, xsum);
        if (lora) lora_add(md->lora, md->num_adapters, L, i, 3, row_adapter, q, dq, M, l->down_kp, I, out, H, lx);
        if (sandwich) rmsnorm_add(branch, M, H, l->mlp_out_norm, l->out_eps, x);
        else if (scaled) scaled_add(branch, M, H, md->residual_scale, x);
    }
    free(scores);
    free(lx);
    free(branch);
    free(pq);
    free(pdq);
    for (int64_t s = 0; s < S; s++) /* out_rows[s] >= s (ascending): no source is overwritten before it is read */
        if (out_rows[s] != s) memcpy(x + s * H, x + out_rows[s] * H, (size_t)H * sizeof(float));
    if (S == 0) return 1;
    input_quantize(md, x, S, H, md->final_norm, md->final_norm_bias, md->final_eps, tmp, md->lm_head_kp, q, dq);
    rk_linear(q, dq, S, md->lm_head_kp, md->lm_head, md->group, md->lm_head_bits, md->lm_head_bias, md->vocab, logits,
              md->vocab, 0, xsum);
    return 1;
}
