"""The memory-lean TTT attention kernels match the naive reference (values and gradients)."""
import pytest
import torch

import draftsmith.draft.ttt_attention as ta
from draftsmith.draft.model import Eagle3Config, Eagle3Drafter


def inputs(B=2, nh=4, nkv=2, L=37, hd=8, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, L, hd, generator=g, dtype=torch.float64).requires_grad_()
    ks = [torch.randn(B, nkv, L, hd, generator=g, dtype=torch.float64).requires_grad_() for _ in range(steps)]
    vs = [torch.randn(B, nkv, L, hd, generator=g, dtype=torch.float64).requires_grad_() for _ in range(steps)]
    return q, ks, vs


def value_and_grads(fn, q, ks, vs):
    o = fn(q, ks, vs)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype).to(o.device)
    grads = torch.autograd.grad((o * w).sum(), [q, *ks, *vs])
    return o.detach(), grads


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("block_scores", [ta.CHUNK_SCORES, 2 * 4 * 37 * 5])  # one block / 5-row blocks
def test_chunked_matches_reference(steps, block_scores, monkeypatch):
    monkeypatch.setattr(ta, "CHUNK_SCORES", block_scores)
    q, ks, vs = inputs(steps=steps)
    scale = 8 ** -0.5
    ref_o, ref_g = value_and_grads(lambda *a: ta.ttt_attention_reference(*a, scale), q, ks, vs)
    o, g = value_and_grads(lambda *a: ta.ttt_attention(*a, scale, "chunked"), q, ks, vs)
    # float64 inputs: the two differ only by summation order
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_chunked_gradcheck():
    q, ks, vs = inputs(B=1, nh=2, nkv=1, L=6, hd=4, steps=3)
    kd, vd = torch.stack(ks[1:], 3).repeat_interleave(2, 1), torch.stack(vs[1:], 3).repeat_interleave(2, 1)
    k0, v0 = ks[0].repeat_interleave(2, 1), vs[0].repeat_interleave(2, 1)
    fn = lambda q, k0, v0, kd, vd: ta._ChunkedTTTAttention.apply(q, k0, v0, kd, vd, 0.5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k0, v0, kd, vd))


def test_flex_mask_matches_reference():
    """The flex block mask gives the reference result (eager flex on CPU: forward only, torch
    has no CPU flex backward; the compiled CUDA kernel's gradients are checked in the gpu test)."""
    q, ks, vs = inputs(B=1, nh=2, nkv=1, L=21, hd=8, steps=3)
    q, ks, vs = q.detach().float(), [k.detach().float() for k in ks], [v.detach().float() for v in vs]
    scale = 8 ** -0.5
    o = ta.ttt_attention_flex(q, ks, vs, scale, compiled=False)
    torch.testing.assert_close(o, ta.ttt_attention_reference(q, ks, vs, scale), rtol=1e-5, atol=1e-5)


def test_drafter_ttt_steps_agree_across_kernels():
    """Three unrolled TTT steps of a tiny drafter: same g and parameter gradients per kernel."""
    cfg = Eagle3Config(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, vocab_size=50, draft_vocab_size=20)
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg).double()
    ids = torch.randint(0, 50, (2, 19))
    aux = torch.randn(2, 19, 96, dtype=torch.float64)
    pos = torch.arange(19)[None].expand(2, 19)

    def run(impl):
        model.zero_grad()
        h, cache, outs = model.project(aux), [], []
        for i in range(3):
            h = model.ttt_step(ids, h, pos + i, cache, impl)
            outs.append(h)
        torch.stack(outs).pow(2).mean().backward()
        return torch.stack(outs).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_o, ref_g = run("reference")
    o, g = run("chunked")
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-12)
    assert set(g) == set(ref_g)
    for n in g:
        torch.testing.assert_close(g[n], ref_g[n], rtol=1e-9, atol=1e-12)


@pytest.mark.gpu
def test_compiled_flex_on_cuda_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    q, ks, vs = inputs(B=2, nh=8, nkv=2, L=300, hd=64, steps=4)
    q, ks, vs = (q.cuda().bfloat16().detach().requires_grad_(), [k.cuda().bfloat16().detach().requires_grad_() for k in ks],
                 [v.cuda().bfloat16().detach().requires_grad_() for v in vs])
    scale = 64 ** -0.5
    ref_o, ref_g = value_and_grads(lambda *a: ta.ttt_attention_reference(*a, scale), q, ks, vs)
    o, g = value_and_grads(lambda *a: ta.ttt_attention(*a, scale, "auto"), q, ks, vs)
    torch.testing.assert_close(o.float(), ref_o.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


# -------------------------------------------------------------- packed batches (document masking)

LENGTHS = [37, 5, 130, 1, 60]  # samples end to end in one row of PACKED (the rest is padding)
PACKED = 260


def packed_docs(lengths=LENGTHS, total=PACKED):
    docs = torch.full((1, total), len(lengths), dtype=torch.int32)
    c = 0
    for d, n in enumerate(lengths):
        docs[0, c:c + n] = d
        c += n
    return docs


def packed_inputs(steps, nh=4, nkv=2, hd=8, dtype=torch.float64):
    """q/k/v of one packed row: the samples' rows end to end, then padding (random too: the
    mask must keep it out)."""
    g = torch.Generator().manual_seed(3)
    mk = lambda n: torch.randn(1, n, PACKED, hd, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(nh), [mk(nkv) for _ in range(steps)], [mk(nkv) for _ in range(steps)]


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_equals_each_sample_alone(impl, steps, dtype, monkeypatch):
    """Document-masked attention over a packed row gives each sample's own (unpacked) result,
    outputs and gradients, for every kernel (chunked step 0: causal attention per sample); 9-row
    query blocks make the chunked kernel start its keys mid-row (at a document start)."""
    monkeypatch.setattr(ta, "CHUNK_SCORES", 4 * PACKED * 9)
    q, ks, vs = packed_inputs(steps, dtype=dtype)
    scale = 8 ** -0.5
    o, g = value_and_grads(lambda *a: ta.ttt_attention(*a, scale, impl, ta.TTTMask(packed_docs())), q, ks, vs)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    c = 0
    for n in LENGTHS:  # each sample alone, through the reference, with the same output weights
        cut = lambda t: t[:, :, c:c + n].detach().requires_grad_()  # noqa: E731
        qs, kss, vss = cut(q), [cut(k) for k in ks], [cut(v) for v in vs]
        os_ = ta.ttt_attention_reference(qs, kss, vss, scale)
        gs = torch.autograd.grad((os_ * w[:, :, c:c + n]).sum(), [qs, *kss, *vss])
        torch.testing.assert_close(o[:, :, c:c + n], os_.detach(), **tol)
        for a, b in zip(g, gs):
            torch.testing.assert_close(a[:, :, c:c + n], b, **tol)
        c += n


@pytest.mark.parametrize("steps", [1, 2])
def test_chunked_kernel_with_documents_gradcheck(steps, monkeypatch):
    """The chunked kernel itself with document ids on two packed rows (a one-row step 0 takes
    causal attention per sample instead): 3-row query blocks, gradcheck and the reference."""
    monkeypatch.setattr(ta, "CHUNK_SCORES", 2 * 2 * 9 * 3)
    q, ks, vs = inputs(B=2, nh=2, nkv=1, L=9, hd=4, steps=steps)
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]])
    fn = lambda q, *kv: ta.ttt_attention(q, list(kv[:steps]), list(kv[steps:]), 0.5, "chunked", ta.TTTMask(docs))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, *ks, *vs))
    torch.testing.assert_close(fn(q, *ks, *vs), ta.ttt_attention_reference(q, ks, vs, 0.5, docs), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("steps", [1, 3])
def test_flex_document_mask_matches_reference(steps):
    """The hand-built flex block mask (block lists from per-block document ids) gives the
    reference result on a packed row whose length is not a multiple of the block size (eager
    flex on CPU: forward only, torch has no CPU flex backward)."""
    q, ks, vs = packed_inputs(steps, dtype=torch.float32)
    q, ks, vs = q.detach(), [k.detach() for k in ks], [v.detach() for v in vs]
    mask = ta.TTTMask(packed_docs())
    o = ta.ttt_attention_flex(q, ks, vs, 8 ** -0.5, compiled=False, mask=mask)
    torch.testing.assert_close(o, ta.ttt_attention_reference(q, ks, vs, 8 ** -0.5, mask.docs), rtol=1e-5, atol=1e-5)


def test_flex_block_lists_skip_other_documents():
    """Blocks whose keys all lie in other documents are not listed; a block inside one document,
    before the query block, is listed as full (no per-element mask)."""
    docs = torch.tensor([[0] * 256 + [1] * 256], dtype=torch.int32)  # blocks 0,1: doc 0; blocks 2,3: doc 1
    bm = ta._flex_block_mask(docs, 2)
    partial = [sorted(bm.kv_indices[0, 0, qb, :bm.kv_num_blocks[0, 0, qb]].tolist()) for qb in range(4)]
    full = [sorted(bm.full_kv_indices[0, 0, qb, :bm.full_kv_num_blocks[0, 0, qb]].tolist()) for qb in range(4)]
    assert partial == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the diagonal block of steps 0 and 1
    assert full == [[], [0], [], [2]]  # earlier blocks of the same document only


def test_compiled_flex_compiles_once_for_a_fixed_shape():
    """torch.compile'd flex attention (CPU: forward) over fixed-shape packed rows with different
    document layouts: one compiled graph per TTT step count, no recompilation per batch."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    q, ks, vs = packed_inputs(2, nh=2, nkv=1, dtype=torch.float32)
    q, ks, vs = q.detach(), [k.detach() for k in ks], [v.detach() for v in vs]
    for lengths in ([37, 5, 130, 1, 60], [260], [100, 100, 20]):
        mask = ta.TTTMask(packed_docs(lengths))
        for steps in (1, 2):
            o = ta.ttt_attention_flex(q, ks[:steps], vs[:steps], 8 ** -0.5, compiled=True, mask=mask)
            ref = ta.ttt_attention_reference(q, ks[:steps], vs[:steps], 8 ** -0.5, mask.docs)
            torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])


def tiny_drafter(draft_vocab: int, data_seed: int):
    """A float64 drafter (H 32, vocab 50, aux input 96), the target's head rows of its draft vocab,
    and a generator for the batch's data."""
    cfg = Eagle3Config(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, vocab_size=50, draft_vocab_size=draft_vocab)
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg).double()
    return model, torch.randn(draft_vocab, 32, dtype=torch.float64), torch.Generator().manual_seed(data_seed)


def test_drafter_ttt_loss_packed_equals_padded():
    """The TTT loss of samples packed into one row (positions restarting, document ids, labels
    not crossing a sample) equals that of the same samples padded one per row: loss, CE,
    accuracy counts, weights and every parameter gradient."""
    from draftsmith.data.shards import Sample
    from draftsmith.data.batch import collate
    from draftsmith.train.ttt import position_weights, ttt_loss

    model, head, g = tiny_drafter(20, data_seed=5)
    samples = []
    for n in (19, 3, 11, 26):
        mask = torch.rand(n, generator=g) < 0.7
        samples.append(Sample(torch.randint(0, 50, (n,), generator=g), mask, 0,
                              torch.randn(n, 96, generator=g, dtype=torch.float64), torch.randn(n, 32, generator=g, dtype=torch.float64)))
    steps = 3
    wt = torch.stack([position_weights(s.loss_mask, steps) for s in samples]).sum(0)

    def run(batch, impl):
        model.zero_grad()
        out = ttt_loss(model, batch.input_ids, batch.loss_mask, batch.aux_hidden, batch.final_hidden, head, steps, 0.8, wt,
                       impl, batch.position_ids, batch.doc_ids)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # ttt_loss takes the log-softmax in float32 (summation order then shows at ~1e-7)
    ref, ref_g = run(collate(samples, None), "reference")
    assert torch.equal(ref.weight, wt)  # every label counted once, none across a sample
    for impl in ("reference", "chunked"):
        out, grads = run(collate(samples, 64), impl)
        for a, b in zip((out.loss, out.ce, out.correct, out.weight), (ref.loss, ref.ce, ref.correct, ref.weight)):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        for n in ref_g:
            torch.testing.assert_close(grads[n], ref_g[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.gpu
def test_compiled_flex_on_cuda_packed_equals_each_sample_alone():
    """On CUDA (compiled flex, forward and backward): a packed row with document ids gives each
    sample's own reference result (bf16 tolerance)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    q, ks, vs = packed_inputs(4, nh=8, nkv=2, hd=64, dtype=torch.float32)
    prep = lambda t: t.detach().cuda().bfloat16().requires_grad_()  # noqa: E731
    q, ks, vs = prep(q), [prep(k) for k in ks], [prep(v) for v in vs]
    scale = 64 ** -0.5
    docs = packed_docs().cuda()
    o, g = value_and_grads(lambda *a: ta.ttt_attention(*a, scale, "flex", ta.TTTMask(docs)), q, ks, vs)
    ref_o, ref_g = value_and_grads(lambda *a: ta.ttt_attention_reference(*a, scale, docs), q, ks, vs)
    n = sum(LENGTHS)  # real rows (padding rows see only padding: both agree there too)
    torch.testing.assert_close(o[:, :, :n].float(), ref_o[:, :, :n].float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("impl", ["reference", "flex"])
def test_compiled_ttt_loss_traces_once_and_matches_eager(impl):
    """TTTLoss with compile_backend: the whole unrolled loss is one graph (no graph break, the
    rotary tables and the batch's TTTMask prepared eagerly), traced once for the fixed packed
    shape whatever the samples in it, and gives the eager loss (and, reference attention, the
    eager gradients; flex on CPU: forward only). aot_eager traces what inductor would compile."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from draftsmith.data.shards import Sample
    from draftsmith.data.batch import collate
    from draftsmith.train.ttt import TTTLoss, position_weights

    cfg = Eagle3Config(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, vocab_size=50, draft_vocab_size=20, rope_scaling={"rope_type": "linear", "factor": 2.0})
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    eager, compiled = TTTLoss(drafter, 2, 0.8, impl), TTTLoss(drafter, 2, 0.8, impl, compile_backend="aot_eager")
    head = torch.randn(20, 32)
    g = torch.Generator().manual_seed(5)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for lengths in ([19, 3, 11, 26], [64], [5, 5, 5, 5, 5]):
        samples = [Sample(torch.randint(0, 50, (n,), generator=g), torch.rand(n, generator=g) < 0.7, 0,
                          torch.randn(n, 96, generator=g), torch.randn(n, 32, generator=g)) for n in lengths]
        b = collate(samples, 64)
        wt = torch.stack([position_weights(s.loss_mask, 2) for s in samples]).sum(0)
        results = []
        for model in (eager, compiled):
            drafter.zero_grad()
            with torch.set_grad_enabled(impl == "reference"):
                out = model(b.input_ids, b.loss_mask, b.aux_hidden, b.final_hidden, head, wt, b.position_ids, b.doc_ids)
                if impl == "reference":
                    out[0].backward()
            results.append((out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
        (out_e, grad_e), (out_c, grad_c) = results
        for a, c in zip(out_e, out_c):
            torch.testing.assert_close(c.detach(), a.detach(), rtol=1e-5, atol=1e-5)
        assert grad_e.keys() == grad_c.keys() and (impl == "flex" or grad_e)
        for n in grad_e:
            torch.testing.assert_close(grad_c[n], grad_e[n], rtol=1e-5, atol=1e-6, msg=n)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1] >= 1 and not counters["recompiles"], (graphs, dict(counters["recompiles"]))
    assert not counters["graph_break"], list(counters["graph_break"])[:1]


def test_ttt_loss_align_topk_counts_only_aligned_rows():
    """train.ttt_align_topk: with k = 1 step i > 0 learns at row t only while the drafter's argmax
    matched the target's at steps 0..i-1 of row t (per-row CE and hits read one row at a time
    through a one-hot loss mask, then summed by hand); with k = the draft vocab every row stays
    aligned: the plain loss. Chain acceptance counts the rows whose hits run unbroken from step 0."""
    from draftsmith.train.ttt import position_weights, ttt_loss

    V = 3  # a small draft vocab: the random drafter hits about a third of the rows
    model, head, g = tiny_drafter(V, data_seed=3)
    L, steps = 40, 3
    ids = torch.randint(0, 50, (1, L), generator=g)
    aux, final = torch.randn(1, L, 96, generator=g, dtype=torch.float64), torch.randn(1, L, 32, generator=g, dtype=torch.float64)
    loss = lambda mask, wt, k: ttt_loss(model, ids, mask, aux, final, head, steps, 1.0, wt, "reference", align_topk=k)  # noqa: E731
    ce, hit = torch.zeros(steps, L, dtype=torch.float64), torch.zeros(steps, L, dtype=torch.float64)
    for p in range(L):  # w_i[t] = mask[t+2+i]: a one-hot mask at p reads row p-2-i of step i
        out = loss(torch.eye(L, dtype=torch.float64)[p][None], torch.ones(steps), 0)
        for i in range(steps):
            if p - 2 - i >= 0:
                ce[i, p - 2 - i], hit[i, p - 2 - i] = out.ce[i], out.correct[i]
    full = torch.ones(1, L, dtype=torch.float64)
    wt = position_weights(full, steps)
    alive, expect = torch.ones(L, dtype=torch.float64), 0.0
    for i in range(steps):
        expect = expect + (ce[i] * alive).sum() / wt[i]
        assert i == 0 or 0 < alive[:L - 2 - i].sum() < L - 2 - i  # both kinds of rows at every later step
        alive = alive * hit[i]
    aligned, plain = loss(full, wt, 1), loss(full, wt, 0)
    torch.testing.assert_close(aligned.loss.double(), expect, rtol=1e-6, atol=1e-6)  # log-softmax in float32
    assert aligned.loss < plain.loss
    assert torch.equal(aligned.correct, plain.correct) and torch.equal(aligned.weight, plain.weight)  # metrics: every row
    assert torch.equal(loss(full, wt, V).loss, plain.loss)
    run = torch.cumprod(hit, 0)  # chain acceptance: rows whose drafts matched at every step so far
    torch.testing.assert_close(plain.chain.double(), torch.stack([run[i, :L - 2 - i].sum() for i in range(steps)]))


def test_ttt_loss_target_temperature_is_the_target_logits_scaled():
    """train.ttt_target_temperature T: the drafter learns softmax(logits / T), so T = 0.5 gives
    exactly the loss of final hidden states doubled (logits = final @ head.T) at T = 1, and T = 0
    (hard labels: the target's argmax alone) the limit of a saturated softmax. The argmax, and so
    accuracy and chain counts, do not move."""
    from draftsmith.train.ttt import ttt_loss

    model, head, g = tiny_drafter(7, data_seed=1)
    L, steps = 24, 3
    ids = torch.randint(0, 50, (1, L), generator=g)
    aux, final = torch.randn(1, L, 96, generator=g, dtype=torch.float64), torch.randn(1, L, 32, generator=g, dtype=torch.float64)
    mask = torch.ones(1, L, dtype=torch.float64)
    loss = lambda f, t: ttt_loss(model, ids, mask, aux, f, head, steps, 1.0, None, "reference", temperature=t)  # noqa: E731
    soft, half, hard = loss(final, 1.0), loss(final, 0.5), loss(final, 0.0)
    torch.testing.assert_close(half.loss, loss(2 * final, 1.0).loss)
    torch.testing.assert_close(hard.loss, loss(1e4 * final, 1.0).loss)
    assert not torch.allclose(soft.loss, half.loss) and not torch.allclose(half.loss, hard.loss)
    for out in (half, hard):
        assert torch.equal(out.correct, soft.correct) and torch.equal(out.chain, soft.chain)


def test_ttt_loss_sampled_acceptance():
    """sample_temperature S: accept[i] sums, over the weighted rows t of step i, the probability that
    speculative sampling at S accepts the drafter's token, sum_v min(p_S, q_S) with p_S the target's
    softmax(final[t+1+i] @ head.T / S). Golden: a drafter whose lm_head is zero drafts the uniform law,
    so accept is sum_v min(p_S, 1/V) computed from the target alone. Its limit S -> 0 is greedy
    acceptance (accept == correct), it does not depend on the temperature the drafter learns at, it is
    at most the weight, and it is absent unless asked for."""
    from draftsmith.train.ttt import ttt_loss

    V, L, steps = 9, 30, 3
    model, head, g = tiny_drafter(V, data_seed=2)
    ids = torch.randint(0, 50, (1, L), generator=g)
    aux, final = torch.randn(1, L, 96, generator=g, dtype=torch.float64), torch.randn(1, L, 32, generator=g, dtype=torch.float64)
    mask = (torch.rand(1, L, generator=g) < 0.8).double()
    run = lambda s, t=1.0: ttt_loss(model, ids, mask, aux, final, head, steps, 1.0, None, "reference", temperature=t,  # noqa: E731
                                    sample_temperature=s)
    assert run(0.0).accept is None
    for s in (0.7, 1.0):
        out = run(s)
        assert torch.all(out.accept <= out.weight + 1e-9) and torch.all(out.accept > 0)
        torch.testing.assert_close(out.accept, run(s, t=0.5).accept)  # the loss's temperature leaves it alone
    torch.testing.assert_close(run(1e-9).accept, run(1.0).correct)   # greedy is the limit
    with torch.no_grad():
        model.lm_head.weight.zero_()
    for s in (0.5, 1.0):
        p = torch.softmax(final[0] @ head.T / s, -1)  # [L, V]: the target's law at each position
        alpha = torch.minimum(p, torch.full_like(p, 1 / V)).sum(-1)
        expect = torch.stack([(alpha[1 + i:L - 1] * mask[0, 2 + i:]).sum() for i in range(steps)])  # row t: w = mask[t+2+i]
        torch.testing.assert_close(run(s).accept, expect.float())  # the target's law is float32 (target_distribution)
