/*
 * Paged decode attention for the CPU, reading K/V in place from the paged cache.
 *
 * One query token per sequence (a decode step), grouped-query attention.
 * The torch path gathers every sequence's whole context out of the paged
 * cache and then runs SDPA on the copy; this kernel walks the block table
 * instead, so each K/V byte is read once per step, and it splits long
 * contexts into partitions of PART tokens (flash-decoding) so that a batch of
 * one still keeps every thread busy.
 *
 *   q      [B, hq, d]            row stride q_stride (elements), head stride d
 *   cache  [N, bs, hk, d]        one layer's K (or V); slot = block * bs + offset
 *   table  [B, max_blocks] int64 block ids; the first ceil(len / bs) are read
 *   lens   [B] int64             context length of each sequence, >= 1
 *   out    [B, hq, d]            contiguous
 *
 * Query head h uses KV head h / g (g = hq / hk). Work items are (sequence,
 * kv head, partition); each computes, for its g query heads, the partial
 * max m, sum s and unnormalised weighted sum of V; a second pass merges the
 * partitions: out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) s_p.
 * Scores and probabilities stay in fp32 whatever the cache dtype.
 *
 * dtype 0 = float32, 1 = bfloat16 (stored as uint16). With AVX-512 (and
 * AVX512-BF16 for bf16) and head_dim 64 or 128, items run a version
 * specialised on (g, d) whose accumulators live in registers; otherwise a
 * portable loop the compiler vectorises.
 *
 * Built at first use by kvtier/engine/cpu_attention.py with -fopenmp:
 * libgomp resolves to the copy torch already loaded (same soname), so the
 * parallel loops run on torch's thread pool and torch.set_num_threads
 * applies here too.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PART 256
#define MAX_D 256
#define MAX_G 16

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline void load_row(int dtype, const void *base, int64_t index, int64_t d, float *dst) {
    if (dtype == DT_F32) {
        memcpy(dst, (const float *)base + index, (size_t)d * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

/* Scores -> probabilities in place (sc[j][0 .. n)); writes each row's max and sum. */
static inline void softmax_rows(float (*sc)[PART], int64_t g, int64_t n, const float *mx,
                                float *m, float *s) {
    for (int64_t j = 0; j < g; j++) {
        float sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            const float e = expf(sc[j][t] - mx[j]);
            sc[j][t] = e;
            sum += e;
        }
        m[j] = mx[j];
        s[j] = sum;
    }
}

typedef void (*item_fn)(const void *q, const void *k_cache, const void *v_cache,
                        const int64_t *blocks, int64_t t0, int64_t t1, int64_t hk, int64_t h,
                        int64_t bs, float scale, float *m, float *s, float *acc);

/* The portable item: any g <= MAX_G, d <= MAX_D, either dtype. */
static void item_generic(int dtype, const void *q, const void *k_cache, const void *v_cache,
                         const int64_t *blocks, int64_t t0, int64_t t1, int64_t hk, int64_t h,
                         int64_t g, int64_t d, int64_t bs, float scale, float *m, float *s,
                         float *acc) {
    float qf[MAX_G][MAX_D], row[MAX_D], sc[MAX_G][PART], mx[MAX_G];
    for (int64_t j = 0; j < g; j++) {
        load_row(dtype, q, j * d, d, qf[j]);
        for (int64_t i = 0; i < d; i++) qf[j][i] *= scale;
        mx[j] = -FLT_MAX;
    }
    for (int64_t t = t0; t < t1; t++) {
        load_row(dtype, k_cache, ((blocks[t / bs] * bs + t % bs) * hk + h) * d, d, row);
        for (int64_t j = 0; j < g; j++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < d; i++) dot += qf[j][i] * row[i];
            sc[j][t - t0] = dot;
            mx[j] = dot > mx[j] ? dot : mx[j];
        }
    }
    softmax_rows(sc, g, t1 - t0, mx, m, s);
    memset(acc, 0, (size_t)(g * d) * sizeof(float));
    for (int64_t t = t0; t < t1; t++) {
        load_row(dtype, v_cache, ((blocks[t / bs] * bs + t % bs) * hk + h) * d, d, row);
        for (int64_t j = 0; j < g; j++) {
            const float p = sc[j][t - t0];
            float *a = acc + j * d;
            for (int64_t i = 0; i < d; i++) a[i] += p * row[i];
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512_ITEMS 1

/* Row loaders for the specialised items: ROW(v, c) = fp32 lanes 16c .. 16c+15. */
static inline __m512 row16_f32(const void *base, int64_t index, int c) {
    return _mm512_loadu_ps((const float *)base + index + 16 * c);
}
static inline __m512 row16_bf16(const void *base, int64_t index, int c) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index + 16 * c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* An item specialised on the group size G and head dim D, for one dtype (row loader ROW). */
#define DEFINE_ITEM(NAME, ROW, G, D)                                                         \
    static void NAME(const void *q, const void *k_cache, const void *v_cache,                \
                     const int64_t *blocks, int64_t t0, int64_t t1, int64_t hk, int64_t h,   \
                     int64_t bs, float scale, float *m, float *s, float *acc_out) {          \
        float sc[G][PART], mx[G];                                                            \
        __m512 qv[G][D / 16];                                                                \
        for (int j = 0; j < G; j++) {                                                        \
            mx[j] = -FLT_MAX;                                                                \
            for (int c = 0; c < D / 16; c++)                                                 \
                qv[j][c] = _mm512_mul_ps(ROW(q, j * D, c), _mm512_set1_ps(scale));           \
        }                                                                                    \
        for (int64_t t = t0; t < t1; t++) {                                                  \
            const int64_t row = ((blocks[t / bs] * bs + t % bs) * hk + h) * D;               \
            __m512 kv[D / 16];                                                               \
            for (int c = 0; c < D / 16; c++) kv[c] = ROW(k_cache, row, c);                   \
            for (int j = 0; j < G; j++) {                                                    \
                __m512 a = _mm512_mul_ps(qv[j][0], kv[0]);                                   \
                for (int c = 1; c < D / 16; c++) a = _mm512_fmadd_ps(qv[j][c], kv[c], a);    \
                const float dot = _mm512_reduce_add_ps(a);                                   \
                sc[j][t - t0] = dot;                                                         \
                mx[j] = dot > mx[j] ? dot : mx[j];                                           \
            }                                                                                \
        }                                                                                    \
        softmax_rows(sc, G, t1 - t0, mx, m, s);                                              \
        __m512 acc[G][D / 16];                                                               \
        for (int j = 0; j < G; j++)                                                          \
            for (int c = 0; c < D / 16; c++) acc[j][c] = _mm512_setzero_ps();                \
        for (int64_t t = t0; t < t1; t++) {                                                  \
            const int64_t row = ((blocks[t / bs] * bs + t % bs) * hk + h) * D;               \
            __m512 vf[D / 16];                                                               \
            for (int c = 0; c < D / 16; c++) vf[c] = ROW(v_cache, row, c);                   \
            for (int j = 0; j < G; j++) {                                                    \
                const __m512 p = _mm512_set1_ps(sc[j][t - t0]);                              \
                for (int c = 0; c < D / 16; c++) acc[j][c] = _mm512_fmadd_ps(p, vf[c], acc[j][c]); \
            }                                                                                \
        }                                                                                    \
        for (int j = 0; j < G; j++)                                                          \
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(acc_out + j * D + 16 * c, acc[j][c]); \
    }

#define DEFINE_ITEMS(TAG, ROW, D)                                                            \
    DEFINE_ITEM(item_##TAG##_g1_d##D, ROW, 1, D) DEFINE_ITEM(item_##TAG##_g2_d##D, ROW, 2, D) \
    DEFINE_ITEM(item_##TAG##_g3_d##D, ROW, 3, D) DEFINE_ITEM(item_##TAG##_g4_d##D, ROW, 4, D) \
    DEFINE_ITEM(item_##TAG##_g5_d##D, ROW, 5, D) DEFINE_ITEM(item_##TAG##_g6_d##D, ROW, 6, D) \
    DEFINE_ITEM(item_##TAG##_g7_d##D, ROW, 7, D) DEFINE_ITEM(item_##TAG##_g8_d##D, ROW, 8, D) \
    static const item_fn items_##TAG##_d##D[8] = {                                          \
        item_##TAG##_g1_d##D, item_##TAG##_g2_d##D, item_##TAG##_g3_d##D, item_##TAG##_g4_d##D, \
        item_##TAG##_g5_d##D, item_##TAG##_g6_d##D, item_##TAG##_g7_d##D, item_##TAG##_g8_d##D};

DEFINE_ITEMS(f32, row16_f32, 64)
DEFINE_ITEMS(f32, row16_f32, 128)
DEFINE_ITEMS(bf16, row16_bf16, 64)
DEFINE_ITEMS(bf16, row16_bf16, 128)

static item_fn pick_item(int dtype, int64_t g, int64_t d) {
    if (g < 1 || g > 8 || (d != 64 && d != 128)) return NULL;
    if (dtype == DT_F32) return d == 64 ? items_f32_d64[g - 1] : items_f32_d128[g - 1];
    return d == 64 ? items_bf16_d64[g - 1] : items_bf16_d128[g - 1];
}
#endif

/* 1 when this build has the specialised AVX-512 items (for the tests and docs). */
int kvt_has_avx512_items(void) {
#ifdef HAVE_AVX512_ITEMS
    return 1;
#else
    return 0;
#endif
}

int kvt_abi_version(void) { return 1; }

/*
 * Returns 0 on success; 1 bad dtype, 2 unsupported shape (hq % hk, d or g too
 * large), 3 a context length outside [1, max_blocks * bs], 4 out of memory.
 */
int kvt_paged_decode(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                     const void *v_cache, void *out, const int64_t *table,
                     const int64_t *lens, int64_t B, int64_t max_blocks, int64_t hq,
                     int64_t hk, int64_t d, int64_t bs, float scale) {
    if (dtype != DT_F32 && dtype != DT_BF16) return 1;
    if (hk <= 0 || hq % hk != 0 || d < 1 || d > MAX_D || hq / hk > MAX_G || bs <= 0) return 2;
    const int64_t g = hq / hk;
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    int64_t max_parts = 1;
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] < 1 || lens[b] > max_blocks * bs) return 3;
        const int64_t p = (lens[b] + PART - 1) / PART;
        if (p > max_parts) max_parts = p;
    }
    const int64_t items = B * hk * max_parts;
    const int64_t stride = g * (d + 2); /* per item: g maxima, g sums, g x d values */
    float *work = (float *)malloc((size_t)(items * stride) * sizeof(float));
    if (work == NULL) return 4;
#ifdef HAVE_AVX512_ITEMS
    const item_fn fast = pick_item(dtype, g, d);
#endif

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / (hk * max_parts);
        const int64_t h = (it / max_parts) % hk;
        const int64_t t0 = (it % max_parts) * PART;
        const int64_t len = lens[b];
        float *m = work + it * stride, *s = m + g, *acc = s + g;
        if (t0 >= len) { /* an empty partition of a shorter sequence */
            for (int64_t j = 0; j < g; j++) s[j] = 0.0f;
            continue;
        }
        const int64_t t1 = len < t0 + PART ? len : t0 + PART;
        const char *qh = (const char *)q + (size_t)(b * q_stride + h * g * d) * esize;
        const int64_t *blocks = table + b * max_blocks;
#ifdef HAVE_AVX512_ITEMS
        if (fast != NULL) {
            fast(qh, k_cache, v_cache, blocks, t0, t1, hk, h, bs, scale, m, s, acc);
            continue;
        }
#endif
        item_generic(dtype, qh, k_cache, v_cache, blocks, t0, t1, hk, h, g, d, bs, scale, m, s,
                     acc);
    }

#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < B * hk; bh++) {
        const int64_t b = bh / hk, h = bh % hk;
        const int64_t parts = (lens[b] + PART - 1) / PART;
        for (int64_t j = 0; j < g; j++) {
            float mx = -FLT_MAX, o[MAX_D], total = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float mp = work[(bh * max_parts + p) * stride + j];
                mx = mp > mx ? mp : mx;
            }
            memset(o, 0, (size_t)d * sizeof(float));
            for (int64_t p = 0; p < parts; p++) {
                const float *m = work + (bh * max_parts + p) * stride, *s = m + g, *acc = s + g;
                const float w = expf(m[j] - mx);
                total += w * s[j];
                for (int64_t i = 0; i < d; i++) o[i] += w * acc[j * d + i];
            }
            const float inv = 1.0f / total;
            const int64_t base = (b * hq + h * g + j) * d;
            if (dtype == DT_F32) {
                float *dst = (float *)out + base;
                for (int64_t i = 0; i < d; i++) dst[i] = o[i] * inv;
            } else {
                uint16_t *dst = (uint16_t *)out + base;
                for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(o[i] * inv);
            }
        }
    }
    free(work);
    return 0;
}
