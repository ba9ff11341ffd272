/* The scatter's inner loop, a template: scalar.c instantiates it with the row function called through a
 * pointer, avx512_deq.c with its 16-bit rows called directly (inlined). */
#ifndef KV_SCATTER_HEAD_H
#define KV_SCATTER_HEAD_H

#include "kv.h"

/* One run's rows of head h (run: view block, first slot, first token, tokens): V dequantized by DEQ
 * (a row function called directly, so the compiler inlines it; `deq` for the generic instance), K's
 * row copied beside it. The scale group is followed token by token (no division per row). */
#define SCATTER_HEAD(name, DEQ, ROW_COPY)                                                             \
    static void name(const ScatterJob *j, deq_fn deq, const int64_t *run, kv_ssize h) {              \
        (void)deq;                                                                                      \
        const KvRows *q = j->q, *k = j->k;                                                              \
        const KvCache *c = j->c;                                                                        \
        kv_ssize t = (kv_ssize)run[2], tp = t / j->page, in_page = t % j->page;                         \
        kv_ssize head_scale = j->scope == SC_TENSOR ? 0 : h;                                            \
        kv_ssize at = run[0] * c->sn + h * c->sh + run[1] * c->ss; /* the slot's offset in the view */  \
        for (int64_t r = 0; r < run[3]; r++, t++, at += c->ss) {                                        \
            float scale = j->sc[j->scope == SC_PAGE_HEAD ? tp * q->H + h : head_scale];                 \
            DEQ((const uint8_t *)q->base + t * q->st + h * q->sh, q->D, scale, j->v0 + at);             \
            if (k) ROW_COPY(j->k0 + at, k->base + t * k->st + h * k->sh, j->k_row);                     \
            if (++in_page == j->page) in_page = 0, tp++;                                                \
        }                                                                                               \
    }

#endif
