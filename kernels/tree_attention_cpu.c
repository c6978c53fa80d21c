/*
 * Tree attention on CPU over vLLM's paged KV cache in the CPU "vec" layout.
 *
 * The semantics of vllm_ddtree/kernels/reference.py (tree requests only):
 * query row i of a tree request sees every context key (positions before
 * the request's query span) and the tree key ctx + j when bit j of its mask
 * row is set. Keys at or past seq_len are never read.
 *
 * Cache layout ("vec", see kernels/cache_layout.py): per layer
 * [num_blocks, num_kv_heads, block_size, 2 * head_size]; within one
 * (block, head) the first block_size * head_size elements are K^T
 * ([head_size][block_size], token fastest), the next are V
 * ([block_size][head_size]).
 *
 * One task per (tree request, kv head): every query row of the request
 * that reads this kv head (all grouped query heads) walks the request's
 * blocks once with an online softmax in fp32, so each cache block is read
 * once per task, as vLLM's own kernel does. Plain C, built at first use by
 * kernels/cpu_native.py; the tasks run in parallel under OpenMP.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
  uint32_t u = ((uint32_t)x) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define RT 4 /* query rows per tile: K and V are loaded once per tile */

static inline v8f load8(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f select8(v8i m, v8f a, v8f b) { /* m ? a : b, lane-wise */
  return (v8f)((m & (v8i)a) | (~m & (v8i)b));
}

/* exp(x) for x <= 0 on 8 lanes in fp32 (Cephes-style range reduction and
 * polynomial, about 2 ulp), branch-free so that it vectorizes; lanes below
 * -87 (masked keys are -inf) give exactly 0. */
static inline v8f exp_nonpos8(v8f x) {
  const v8f lo = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
  const v8f zero = {0.f};
  const v8i dead = x < lo;
  x = select8(dead, lo, x);
  const v8f y = x * 1.44269504088896341f;
  const v8f k = -__builtin_convertvector(__builtin_convertvector(0.5f - y, v8i), v8f);
  const v8f r = x - k * 0.693359375f + k * 2.12194440e-4f;
  v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v8i bits = (__builtin_convertvector(k, v8i) + 127) << 23;
  return select8(dead, zero, p * (v8f)bits);
}

/* kv_dtype: 0 = float32, 1 = bfloat16. query/out: float32 with the given
 * element strides. head_size must be a multiple of 8 and block_size of 8.
 * Returns 0, or a negative value on bad arguments. */
int ddtree_tree_attention(
    const float *query, int64_t q_stride_tok, int64_t q_stride_head,
    const void *kv_cache, int32_t kv_dtype, int64_t num_kv_heads, int64_t block_size,
    int64_t head_size, const int32_t *block_table, int64_t bt_stride,
    const int32_t *query_start_loc, const int32_t *seq_lens, const int64_t *tree_reqs,
    int64_t num_tree_reqs, const int32_t *mask, int64_t mask_words, int64_t num_q_heads,
    float scale, float *out, int64_t o_stride_tok, int64_t o_stride_head) {
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || block_size <= 0 ||
      block_size % 8 != 0 || head_size <= 0 || head_size % 8 != 0 ||
      (kv_dtype != 0 && kv_dtype != 1))
    return -1;
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t D = head_size, BS = block_size;
  const int64_t block_elems = BS * 2 * D; /* one (block, head) */
  int status = 0;

#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t ti = 0; ti < num_tree_reqs; ++ti) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t r = tree_reqs[ti];
      const int64_t qs = query_start_loc[r];
      const int64_t ql = query_start_loc[r + 1] - qs;
      const int64_t seq = seq_lens[r];
      const int64_t ctx = seq - ql;
      const int64_t rows = ql * group; /* row = node * group + g */
      if (ql <= 0) continue;
      if (ctx < 0 || ql > mask_words * 32) {
#pragma omp atomic write
        status = -2;
        continue;
      }
      const int64_t tiles = (rows + RT - 1) / RT;
      float *m = malloc(sizeof(float) * tiles * RT);
      float *l = malloc(sizeof(float) * tiles * RT);
      float *qbuf = malloc(sizeof(float) * tiles * RT * D);
      float *acc = calloc((size_t)(tiles * RT * D), sizeof(float));
      float *s = malloc(sizeof(float) * RT * BS);
      float *kbuf = kv_dtype ? malloc(sizeof(float) * BS * D) : NULL;
      float *vbuf = kv_dtype ? malloc(sizeof(float) * BS * D) : NULL;
      if (!m || !l || !qbuf || !acc || !s || (kv_dtype && (!kbuf || !vbuf))) {
#pragma omp atomic write
        status = -3;
        free(m); free(l); free(qbuf); free(acc); free(s); free(kbuf); free(vbuf);
        continue;
      }
      /* Scaled queries, one row per (node, g); padding rows repeat the last. */
      for (int64_t row = 0; row < tiles * RT; ++row) {
        const int64_t rr = row < rows ? row : rows - 1;
        const float *q = query + (qs + rr / group) * q_stride_tok +
                         (h * group + rr % group) * q_stride_head;
        for (int64_t d = 0; d < D; ++d) qbuf[row * D + d] = q[d] * scale;
        m[row] = -INFINITY;
        l[row] = 0.f;
      }
      const int64_t nblk = (seq + BS - 1) / BS;
      for (int64_t b = 0; b < nblk; ++b) {
        const int64_t blk = block_table[r * bt_stride + b];
        const int64_t t0 = b * BS;
        const int64_t tn = seq - t0 < BS ? seq - t0 : BS;
        const float *kt, *v;
        if (kv_dtype == 0) {
          const float *base = (const float *)kv_cache + (blk * num_kv_heads + h) * block_elems;
          kt = base;
          v = base + BS * D;
        } else {
          const uint16_t *base =
              (const uint16_t *)kv_cache + (blk * num_kv_heads + h) * block_elems;
          for (int64_t e = 0; e < BS * D; ++e) kbuf[e] = bf16_to_f32(base[e]);
          for (int64_t e = 0; e < BS * D; ++e) vbuf[e] = bf16_to_f32(base[BS * D + e]);
          kt = kbuf;
          v = vbuf;
        }
        const int all_context = t0 + tn <= ctx;
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const float *qt = qbuf + tile * RT * D;
          /* S = Q K^T over the whole block, 8 keys x RT rows in registers. */
          for (int64_t c = 0; c < BS; c += 8) {
            v8f a[RT] = {{0}};
            for (int64_t d = 0; d < D; ++d) {
              const v8f k = load8(kt + d * BS + c);
              for (int i = 0; i < RT; ++i) a[i] += qt[i * D + d] * k;
            }
            for (int i = 0; i < RT; ++i) store8(s + i * BS + c, a[i]);
          }
          for (int i = 0; i < RT; ++i) {
            const int64_t row = tile * RT + i;
            float *sc = s + i * BS;
            /* keys past the sequence hold stale values: never seen */
            for (int64_t t = tn; t < BS; ++t) sc[t] = -INFINITY;
            if (!all_context) {
              const int32_t *mrow = mask + (qs + (row < rows ? row : rows - 1) / group) * mask_words;
              for (int64_t t = 0; t < tn; ++t) {
                const int64_t p = t0 + t;
                if (p >= ctx) {
                  const int64_t j = p - ctx;
                  const uint32_t word = (uint32_t)mrow[j >> 5];
                  if (!((word >> (j & 31)) & 1u)) sc[t] = -INFINITY;
                }
              }
            }
            float bmax = -INFINITY;
            for (int64_t t = 0; t < tn; ++t) bmax = sc[t] > bmax ? sc[t] : bmax;
            if (bmax == -INFINITY) {
              for (int64_t t = 0; t < BS; ++t) sc[t] = 0.f;
              continue;
            }
            const float m_new = m[row] > bmax ? m[row] : bmax;
            const float alpha = expf(m[row] - m_new); /* 0 when m was -inf */
            float lsum = 0.f;
            const v8f mv = {m_new, m_new, m_new, m_new, m_new, m_new, m_new, m_new};
            v8f ls = mv - mv;
            for (int64_t t = 0; t < BS; t += 8) {
              const v8f e = exp_nonpos8(load8(sc + t) - mv); /* -inf lanes give 0 */
              store8(sc + t, e);
              ls += e;
            }
            for (int i = 0; i < 8; ++i) lsum += ls[i];
            l[row] = l[row] * alpha + lsum;
            m[row] = m_new;
            float *ar = acc + row * D;
            for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
          }
          /* acc += P V, 8 head dims x RT rows in registers; t < tn only
           * (past the sequence V may be anything, even NaN). */
          for (int64_t c = 0; c < D; c += 8) {
            v8f a[RT];
            for (int i = 0; i < RT; ++i) a[i] = load8(acc + (tile * RT + i) * D + c);
            for (int64_t t = 0; t < tn; ++t) {
              const v8f vv = load8(v + t * D + c);
              for (int i = 0; i < RT; ++i) a[i] += s[i * BS + t] * vv;
            }
            for (int i = 0; i < RT; ++i) store8(acc + (tile * RT + i) * D + c, a[i]);
          }
        }
      }
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t i = row / group, g = row % group;
        float *o = out + (qs + i) * o_stride_tok + (h * group + g) * o_stride_head;
        const float inv = l[row] > 0.f ? 1.f / l[row] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[row * D + d] * inv;
      }
      free(m); free(l); free(qbuf); free(acc); free(s); free(kbuf); free(vbuf);
    }
  }
  return status;
}
