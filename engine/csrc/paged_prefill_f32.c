/*
 * Paged prefill attention for the CPU in float32: flash attention over the paged cache.
 *
 * The float32 twin of paged_prefill.c, for hosts without native bf16 (the
 * engine runs the model in float32 there). Same contract: one sequence's
 * prefill span per call, q_len new tokens at positions prefix_len ..
 * prefix_len + q_len - 1 whose K/V are already in the paged cache; query i
 * attends keys 0 .. prefix_len + i (causal, lower-right aligned).
 *
 *   q      [q_len, hq, d]      row stride q_stride (elements), head stride d
 *   cache  [N, bs, hk, d]      one layer's K (or V); slot = block * bs + offset
 *   blocks [>= ceil((prefix_len + q_len) / bs)] int64, the sequence's block table
 *   out    [q_len, hq, d]      contiguous
 *
 * Why: without it a span after a cached prefix gathers the whole context
 * out of the cache and runs torch's masked SDPA in query tiles, and torch's
 * CPU flash kernel spends much of a prefill there (docs/engine.md, "Sustained
 * load"). The arithmetic is written with GCC vector extensions, 16 floats
 * wide: one AVX-512 register, two AVX2 ones, whatever -march=native gives,
 * so the same source serves any x86 (or other) CPU the compiler targets.
 *
 * Layout of the work:
 *   1. pack, per KV head: Kt[e][t] = K[t][e]  (d x Np, keys contiguous)
 *                         Vc[t][e] = V[t][e]  (Np x d)
 *      for every key t < prefix_len + q_len, read through the block table;
 *   2. items (kv head, tile of TQ queries): the tile's g query heads stacked
 *      as rows (row = query * g + group member); for each tile of TK keys up
 *      to the tile's last position: S = Q Kt (R rows x TK keys of
 *      accumulators), scale, causal mask, online softmax, O += P V.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* unaligned access */

#define TK 64           /* keys per tile (4 vectors) */
#define TQ 32           /* queries per item */
#define NV (TK / 16)    /* vectors per row of scores */
#define R 6             /* rows per register block: 24 accumulators + 4 loads + 1 broadcast */
#define MASKED (-1e30f) /* a masked score: exp(MASKED - m) is 0 */

static inline v16 ld(const float *p) { return *(const v16u *)p; }
static inline void st(float *p, v16 v) { *(v16u *)p = v; }
static inline v16 splat(float x) { return (v16){0} + x; }

/* S[r][0 .. TK) = sum_e Q[r][e] Kt[e][kt0 ..] for R rows. */
static inline void qk_block(const float *const *qrows, const float *kt, int64_t np, int64_t kt0,
                            int64_t d, float *s) {
    v16 acc[R][NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = (v16){0};
    for (int64_t e = 0; e < d; e++) {
        v16 k[NV];
        for (int c = 0; c < NV; c++) k[c] = ld(kt + e * np + kt0 + 16 * c);
        for (int r = 0; r < R; r++) {
            const v16 qv = splat(qrows[r][e]);
            for (int c = 0; c < NV; c++) acc[r][c] += qv * k[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) st(s + r * TK + 16 * c, acc[r][c]);
}

/* O[r][e0 .. e0 + 64) += sum_t P[r][t] V[kt0 + t][e0 ..] for R rows (4 vectors of output). */
static inline void pv_block64(const float *p, const float *vc, int64_t kt0, int64_t d,
                              int64_t e0, float *o) {
    v16 acc[R][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = ld(o + r * d + e0 + 16 * c);
    for (int t = 0; t < TK; t++) {
        const float *vrow = vc + (kt0 + t) * d + e0;
        v16 v[4];
        for (int c = 0; c < 4; c++) v[c] = ld(vrow + 16 * c);
        for (int r = 0; r < R; r++) {
            const v16 pv = splat(p[r * TK + t]);
            for (int c = 0; c < 4; c++) acc[r][c] += pv * v[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) st(o + r * d + e0 + 16 * c, acc[r][c]);
}

/* The same for one 16-wide vector of output (head sizes that are not a multiple of 64). */
static inline void pv_block16(const float *p, const float *vc, int64_t kt0, int64_t d,
                              int64_t e0, float *o) {
    v16 acc[R];
    for (int r = 0; r < R; r++) acc[r] = ld(o + r * d + e0);
    for (int t = 0; t < TK; t++) {
        const v16 v = ld(vc + (kt0 + t) * d + e0);
        for (int r = 0; r < R; r++) acc[r] += splat(p[r * TK + t]) * v;
    }
    for (int r = 0; r < R; r++) st(o + r * d + e0, acc[r]);
}

static inline int64_t slot_of(const int64_t *blocks, int64_t t, int64_t bs) {
    return blocks[t / bs] * bs + t % bs;
}

/* Packs keys [t0, t0 + TK) of KV head h (zeros past n). */
static void pack_tile(const float *k_cache, const float *v_cache, const int64_t *blocks, int64_t bs,
                      int64_t hk, int64_t h, int64_t d, int64_t n, int64_t np, int64_t t0,
                      float *kt, float *vc) {
    for (int64_t t = t0; t < t0 + TK; t++) {
        if (t < n) {
            const int64_t row = (slot_of(blocks, t, bs) * hk + h) * d;
            const float *k = k_cache + row;
            for (int64_t e = 0; e < d; e++) kt[e * np + t] = k[e];
            memcpy(vc + t * d, v_cache + row, (size_t)d * sizeof(float));
        } else {
            for (int64_t e = 0; e < d; e++) kt[e * np + t] = 0.0f;
            memset(vc + t * d, 0, (size_t)d * sizeof(float));
        }
    }
}

/* One item: KV head h, queries [i0, i1) of the span. */
static void run_item(const float *q, int64_t q_stride, float *out, const float *kt,
                     const float *vc, int64_t np, int64_t prefix_len, int64_t i0, int64_t i1,
                     int64_t hq, int64_t hk, int64_t h, int64_t d, float scale, float *s,
                     float *o, float *m, float *l, const float *zero_row) {
    const int64_t g = hq / hk;
    const int64_t rows = (i1 - i0) * g;
    const int64_t rows_r = (rows + R - 1) / R * R;
    const float *qrows[TQ * 16 + R];
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
        for (int64_t r = 0; r < rows_r; r += R) qk_block(qrows + r, kt, np, kt0, d, s + r * TK);
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
            if (corr != 1.0f) { /* the running max moved: rescale what was summed so far */
                float *orow = o + r * d;
                for (int64_t e = 0; e < d; e++) orow[e] *= corr;
            }
        }
        for (int64_t r = 0; r < rows_r; r += R) {
            int64_t e0 = 0;
            for (; e0 + 64 <= d; e0 += 64) pv_block64(s + r * TK, vc, kt0, d, e0, o + r * d);
            for (; e0 < d; e0 += 16) pv_block16(s + r * TK, vc, kt0, d, e0, o + r * d);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        float *dst = out + ((i0 + r / g) * hq + h * g + r % g) * d;
        const float *orow = o + r * d;
        for (int64_t e = 0; e < d; e++) dst[e] = orow[e] * inv;
    }
}

/*
 * Returns 0 on success; 2 unsupported shape (d not a multiple of 16 or over 256,
 * hq % hk, group > 16), 4 out of memory.
 */
int kvt_paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache,
                          const float *v_cache, float *out, const int64_t *blocks,
                          int64_t prefix_len, int64_t q_len, int64_t hq, int64_t hk, int64_t d,
                          int64_t bs, float scale) {
    if (d % 16 || d > 256 || hk <= 0 || hq % hk || hq / hk > 16 || bs <= 0 || q_len <= 0)
        return 2;
    const int64_t g = hq / hk;
    const int64_t n = prefix_len + q_len;
    const int64_t np = (n + TK - 1) / TK * TK;
    float *kt = (float *)malloc((size_t)(hk * d * np) * sizeof(float));
    float *vc = (float *)malloc((size_t)(hk * np * d) * sizeof(float));
    if (kt == NULL || vc == NULL) {
        free(kt);
        free(vc);
        return 4;
    }
    const int64_t ktiles = np / TK;
#pragma omp parallel for schedule(static)
    for (int64_t it = 0; it < hk * ktiles; it++) {
        const int64_t h = it / ktiles, t0 = (it % ktiles) * TK;
        pack_tile(k_cache, v_cache, blocks, bs, hk, h, d, n, np, t0, kt + h * d * np,
                  vc + h * np * d);
    }
    const int64_t qtiles = (q_len + TQ - 1) / TQ;
    /* per-thread scratch: scores / probabilities, output accumulators, max and sum, a zero row */
    const int64_t rows_r = (TQ * g + R - 1) / R * R;
    const int64_t per = rows_r * TK + rows_r * d + 2 * rows_r + d;
    const int threads = omp_get_max_threads();
    float *scratch = (float *)calloc((size_t)(threads * per), sizeof(float));
    if (scratch == NULL) {
        free(kt);
        free(vc);
        return 4;
    }
    /* later query tiles see more keys: hand out the costly items first */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < hk * qtiles; it++) {
        float *s = scratch + omp_get_thread_num() * per;
        float *o = s + rows_r * TK, *ml = o + rows_r * d, *zero = ml + 2 * rows_r;
        const int64_t tile = qtiles - 1 - it / hk, h = it % hk;
        const int64_t i0 = tile * TQ, i1 = i0 + TQ < q_len ? i0 + TQ : q_len;
        run_item(q, q_stride, out, kt + h * d * np, vc + h * np * d, np, prefix_len, i0, i1, hq,
                 hk, h, d, scale, s, o, ml, ml + rows_r, zero);
    }
    free(scratch);
    free(kt);
    free(vc);
    return 0;
}

/*
 * 1 when a 16-float vector is one register (AVX-512). Without it GCC splits every
 * vector operation in two: on an AVX2 host a cold 2,048-token SmolLM2 prefill took
 * 2.9x as long as with torch's CPU flash kernel (bench/engine.py), so the engine
 * prefills with torch there (cpu_kernels.py, supports_prefill).
 */
int kvt_prefill_f32_native(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
