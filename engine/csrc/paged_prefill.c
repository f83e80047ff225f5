/*
 * Paged prefill attention for the CPU (bfloat16, AVX512-BF16): flash attention over the paged cache.
 *
 * One sequence's prefill span per call: q_len new tokens at positions
 * prefix_len .. prefix_len + q_len - 1, whose K/V are already written into
 * the paged cache next to the prefix's. Query i attends keys 0 .. prefix_len + i
 * (causal, lower-right aligned), so the same call serves a cold prompt
 * (prefix_len 0), a chunk of a chunked prefill and a prompt after a cached
 * or loaded prefix, without gathering the context into a copy first.
 *
 *   q      [q_len, hq, d]      row stride q_stride (elements), head stride d
 *   cache  [N, bs, hk, d]      one layer's K (or V); slot = block * bs + offset
 *   blocks [>= ceil((prefix_len + q_len) / bs)] int64, the sequence's block table
 *   out    [q_len, hq, d]      contiguous
 *
 * Why: torch's CPU flash-attention kernel ran at ~60 GFLOP/s here (2 Zen 4
 * cores, bf16): 57 % of a 2,048-token prefill. This kernel computes both
 * products with vdpbf16ps on VNNI-packed tiles (the layout a dot-product
 * instruction wants: pairs of bf16 along the reduced dimension), keeps the
 * scores and probabilities of a tile in fp32 (online softmax), and rounds P
 * to bf16 for P.V as torch's kernel does.
 *
 * Layout of the work:
 *   1. pack, per KV head: Kp[p][t] = (K[t][2p], K[t][2p+1])   (d/2 x Np uint32)
 *                         Vp[t/2][e] = (V[t][e], V[t+1][e])  (Np/2 x d uint32)
 *      for every key t < prefix_len + q_len, read through the block table;
 *   2. items (kv head, tile of TQ queries): the tile's g query heads stacked
 *      as rows (row = query * g + group member), flash loop over key tiles
 *      of TK keys up to the tile's last position.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define TK 64          /* keys per tile */
#define TQ 64          /* queries per item */
#define MASKED (-1e30f) /* a masked score: exp(MASKED - m) is 0 */

static inline uint32_t load_u32(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Scores of R rows x TK keys: S[r][t] = sum_d Q[r][d] K[t][d] (unscaled). */
#define DEFINE_QK(R)                                                                          \
    static inline void qk_rows##R(const uint16_t *const *qrows, const uint32_t *kp, int64_t np, \
                                  int64_t kt0, int64_t d, float *s) {                          \
        __m512 acc[R][TK / 16];                                                               \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < TK / 16; c++) acc[r][c] = _mm512_setzero_ps();                \
        for (int64_t p = 0; p < d / 2; p++) {                                                 \
            __m512bh kv[TK / 16];                                                             \
            for (int c = 0; c < TK / 16; c++)                                                 \
                kv[c] = (__m512bh)_mm512_loadu_si512((const void *)(kp + p * np + kt0 + 16 * c)); \
            for (int r = 0; r < R; r++) {                                                     \
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)load_u32(qrows[r] + 2 * p)); \
                for (int c = 0; c < TK / 16; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, kv[c]); \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < TK / 16; c++) _mm512_storeu_ps(s + r * TK + 16 * c, acc[r][c]); \
    }
DEFINE_QK(6) /* 6 rows: 24 accumulators, ~7 % faster than 4 on Zen 4/5 */
DEFINE_QK(1)

/* O[r][:] += sum_t P[r][t] V[t][:] for R rows, D output dims (D / 16 vectors per row). */
#define DEFINE_PV(NAME, R, D)                                                                 \
    static inline void NAME(const uint32_t *pp, const uint32_t *vp, int64_t kt0, float *o) {  \
        __m512 acc[R][D / 16];                                                                \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < D / 16; c++) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c); \
        for (int t2 = 0; t2 < TK / 2; t2++) {                                                 \
            __m512bh vv[D / 16];                                                              \
            for (int c = 0; c < D / 16; c++)                                                  \
                vv[c] = (__m512bh)_mm512_loadu_si512((const void *)(vp + (kt0 / 2 + t2) * D + 16 * c)); \
            for (int r = 0; r < R; r++) {                                                     \
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[r * (TK / 2) + t2]);  \
                for (int c = 0; c < D / 16; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]); \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]); \
    }
DEFINE_PV(pv_64_r6, 6, 64)
DEFINE_PV(pv_64_r1, 1, 64)
DEFINE_PV(pv_128_r2, 2, 128)
DEFINE_PV(pv_128_r1, 1, 128)

static inline int64_t slot_of(const int64_t *blocks, int64_t t, int64_t bs) {
    return blocks[t / bs] * bs + t % bs;
}

/* Packs keys [t0, t0 + TK) of KV head h (zeros past n). */
static void pack_tile(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks,
                      int64_t bs, int64_t hk, int64_t h, int64_t d, int64_t n, int64_t np,
                      int64_t t0, uint32_t *kp, uint32_t *vp) {
    for (int64_t t = t0; t < t0 + TK; t++) {
        if (t < n) {
            const int64_t row = (slot_of(blocks, t, bs) * hk + h) * d;
            const uint16_t *k = k_cache + row;
            for (int64_t p = 0; p < d / 2; p++) kp[p * np + t] = load_u32(k + 2 * p);
        } else {
            for (int64_t p = 0; p < d / 2; p++) kp[p * np + t] = 0;
        }
    }
    for (int64_t t = t0; t < t0 + TK; t += 2) {
        const uint16_t *v0 = t < n ? v_cache + (slot_of(blocks, t, bs) * hk + h) * d : NULL;
        const uint16_t *v1 = t + 1 < n ? v_cache + (slot_of(blocks, t + 1, bs) * hk + h) * d : NULL;
        uint32_t *dst = vp + (t / 2) * d;
        for (int64_t e = 0; e < d; e++)
            dst[e] = (uint32_t)(v0 ? v0[e] : 0) | ((uint32_t)(v1 ? v1[e] : 0) << 16);
    }
}

/* One item: KV head h, queries [i0, i1) of the span. */
static void run_item(const uint16_t *q, int64_t q_stride, uint16_t *out, const uint32_t *kp,
                     const uint32_t *vp, int64_t np, int64_t prefix_len, int64_t i0, int64_t i1,
                     int64_t hq, int64_t hk, int64_t h, int64_t d, float scale, float *s,
                     float *o, float *m, float *l, uint32_t *pp) {
    const int64_t g = hq / hk;
    const int64_t rows = (i1 - i0) * g;
    const int64_t rows_r = (rows + 5) / 6 * 6;
    const uint16_t *qrows[TQ * 16 + 6];
    static const uint16_t zero_row[256] = {0};
    for (int64_t r = 0; r < rows_r; r++)
        qrows[r] = r < rows ? q + (i0 + r / g) * q_stride + (h * g + r % g) * d : zero_row;
    memset(o, 0, (size_t)(rows_r * d) * sizeof(float));
    for (int64_t r = 0; r < rows_r; r++) {
        m[r] = MASKED;
        l[r] = 0.0f;
    }
    const int64_t last = prefix_len + i1 - 1; /* the tile's last query position */
    for (int64_t kt0 = 0; kt0 <= last; kt0 += TK) {
        const int masked_tile = kt0 + TK - 1 > prefix_len + i0;
        for (int64_t r = 0; r < rows_r; r += 6) qk_rows6(qrows + r, kp, np, kt0, d, s + r * TK);
        for (int64_t r = 0; r < rows_r; r++) {
            float *sr = s + r * TK;
            const int64_t pos = prefix_len + i0 + r / g;
            float mx = MASKED;
            for (int t = 0; t < TK; t++) {
                float v = sr[t] * scale;
                if (masked_tile && kt0 + t > pos) v = MASKED;
                sr[t] = v;
                mx = v > mx ? v : mx;
            }
            const float m_new = mx > m[r] ? mx : m[r];
            const float corr = expf(m[r] - m_new);
            float sum = 0.0f;
            for (int t = 0; t < TK; t++) {
                const float e = expf(sr[t] - m_new);
                sr[t] = e;
                sum += e;
            }
            l[r] = l[r] * corr + sum;
            m[r] = m_new;
            float *orow = o + r * d;
            for (int64_t e = 0; e < d; e++) orow[e] *= corr;
            /* P to bf16 pairs (round to nearest even) */
            uint32_t *prow = pp + r * (TK / 2);
            for (int t = 0; t < TK; t += 32) {
                const __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + t + 16),
                                                        _mm512_loadu_ps(sr + t));
                _mm512_storeu_si512((void *)(prow + t / 2), (__m512i)pb);
            }
        }
        if (d == 64) {
            for (int64_t r = 0; r < rows_r; r += 6) pv_64_r6(pp + r * (TK / 2), vp, kt0, o + r * d);
        } else {
            for (int64_t r = 0; r < rows_r; r += 2) pv_128_r2(pp + r * (TK / 2), vp, kt0, o + r * d);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        uint16_t *dst = out + ((i0 + r / g) * hq + h * g + r % g) * d;
        const float *orow = o + r * d;
        for (int64_t e = 0; e < d; e += 32) {
            const __m512bh ob = _mm512_cvtne2ps_pbh(
                _mm512_mul_ps(_mm512_loadu_ps(orow + e + 16), _mm512_set1_ps(inv)),
                _mm512_mul_ps(_mm512_loadu_ps(orow + e), _mm512_set1_ps(inv)));
            _mm256_storeu_si256((__m256i *)(dst + e), (__m256i)_mm512_castsi512_si256((__m512i)ob));
            _mm256_storeu_si256((__m256i *)(dst + e + 16),
                                _mm512_extracti64x4_epi64((__m512i)ob, 1));
        }
    }
}

int kvt_has_prefill(void) { return 1; }

/*
 * Returns 0 on success; 2 unsupported shape (d not 64/128, hq % hk, group > 16),
 * 4 out of memory.
 */
int kvt_paged_prefill(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                      const uint16_t *v_cache, uint16_t *out, const int64_t *blocks,
                      int64_t prefix_len, int64_t q_len, int64_t hq, int64_t hk, int64_t d,
                      int64_t bs, float scale) {
    if ((d != 64 && d != 128) || hk <= 0 || hq % hk || hq / hk > 16 || bs <= 0 || q_len <= 0)
        return 2;
    const int64_t g = hq / hk;
    const int64_t n = prefix_len + q_len;
    const int64_t np = (n + TK - 1) / TK * TK;
    uint32_t *kp = (uint32_t *)malloc((size_t)(hk * (d / 2) * np) * sizeof(uint32_t));
    uint32_t *vp = (uint32_t *)malloc((size_t)(hk * (np / 2) * d) * sizeof(uint32_t));
    if (kp == NULL || vp == NULL) {
        free(kp);
        free(vp);
        return 4;
    }
    const int64_t ktiles = np / TK;
#pragma omp parallel for schedule(static)
    for (int64_t it = 0; it < hk * ktiles; it++) {
        const int64_t h = it / ktiles, t0 = (it % ktiles) * TK;
        pack_tile(k_cache, v_cache, blocks, bs, hk, h, d, n, np, t0, kp + h * (d / 2) * np,
                  vp + h * (np / 2) * d);
    }
    const int64_t qtiles = (q_len + TQ - 1) / TQ;
    /* per-thread scratch: scores, output accumulators, max and sum, bf16 probabilities */
    const int64_t rows_r = (TQ * g + 5) / 6 * 6;
    const int64_t per = rows_r * TK + rows_r * d + 2 * rows_r + rows_r * (TK / 2);
    const int threads = omp_get_max_threads();
    float *scratch = (float *)malloc((size_t)(threads * per) * sizeof(float));
    if (scratch == NULL) {
        free(kp);
        free(vp);
        return 4;
    }
    /* later query tiles see more keys: hand out the costly items first */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < hk * qtiles; it++) {
        float *s = scratch + omp_get_thread_num() * per;
        float *o = s + rows_r * TK, *ml = o + rows_r * d;
        uint32_t *pp = (uint32_t *)(ml + 2 * rows_r);
        const int64_t tile = qtiles - 1 - it / hk, h = it % hk;
        const int64_t i0 = tile * TQ, i1 = i0 + TQ < q_len ? i0 + TQ : q_len;
        run_item(q, q_stride, out, kp + h * (d / 2) * np, vp + h * (np / 2) * d, np, prefix_len,
                 i0, i1, hq, hk, h, d, scale, s, o, ml, ml + rows_r, pp);
    }
    free(scratch);
    free(kp);
    free(vp);
    return 0;
}

#else
int kvt_has_prefill(void) { return 0; }

int kvt_paged_prefill(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                      const uint16_t *v_cache, uint16_t *out, const int64_t *blocks,
                      int64_t prefix_len, int64_t q_len, int64_t hq, int64_t hk, int64_t d,
                      int64_t bs, float scale) {
    (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)out; (void)blocks;
    (void)prefix_len; (void)q_len; (void)hq; (void)hk; (void)d; (void)bs; (void)scale;
    return 1;
}
#endif
