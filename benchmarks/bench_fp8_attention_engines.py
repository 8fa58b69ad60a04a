"""Which engine for FP8 attention: cuDNN's FP8 fused attention (NVIDIA's cudnn frontend, `pip install
nvidia-cudnn-frontend`) against torch's fastest bf16 SDPA backend, kernels alone, in one run.

For each shape (head dim 128, causal and not, with and without grouped-query heads) it builds cuDNN FP8 SDPA forward
and backward graphs (Q, K, V in E4M3 with per-tensor descales, the probabilities P in E4M3 with the fixed scale 448,
O in E4M3, dO in E5M2, dQ/dK/dV in the FP8 type cuDNN allows on the chip), times them with CUDA events against torch's
FLASH / CUDNN / EFFICIENT bf16 backends, and reports the forward's error next to bf16's against a float64 attention of
the same FP8-rounded inputs. The FP8 casts of Q, K, V and dO, and O's and dQKV's conversion back, are not in the
times: they are what fp8ext adds around the kernels (or avoids, with FP8 projections feeding attention).

    python benchmarks/bench_fp8_attention_engines.py
"""
import math, statistics, sys, traceback, torch
import torch.nn.functional as F
import cudnn
print("cudnn backend", cudnn.backend_version(), "frontend", getattr(cudnn, "__version__", "?"), "torch", torch.__version__,
      torch.cuda.get_device_name(), flush=True)
E4, E5, FL, BF = cudnn.data_type.FP8_E4M3, cudnn.data_type.FP8_E5M2, cudnn.data_type.FLOAT, cudnn.data_type.BFLOAT16
handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
def bench(fn, reps=20):
    for _ in range(3): fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
def layout(bb, s, h, d):
    return (bb, h, s, d), (s * h * d, d, h * d, 1)
def one(): return torch.ones(1, 1, 1, 1, device="cuda")
def new_graph(q, k):
    """A cuDNN graph with the E4M3 tensors Q, K, V of bshd tensors q and k (v like k): (graph, tensors, Q's and K's
    (dims, strides) as cuDNN reads them: [b, h, s, d] over bshd memory)."""
    bb, s, h, d = q.shape
    g = cudnn.pygraph(io_data_type=E4, intermediate_data_type=FL, compute_data_type=FL, handle=handle)
    (qd, qs), (kd, ks) = layout(bb, s, h, d), layout(bb, s, k.shape[2], d)
    ts = tuple(g.tensor(name=n, dim=dd, stride=ss, data_type=E4) for n, dd, ss in (("q", qd, qs), ("k", kd, ks), ("v", kd, ks)))
    return g, ts, (qd, qs), (kd, ks)
def fwd_graph(q, k, v, causal, out_type):
    g, (tq, tk, tv), (qd, qs), (kd, ks) = new_graph(q, k)
    bb, s, h, d = q.shape
    sc = [g.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=FL) for n in ("dq", "dk", "dv", "ds", "ss", "so")]
    o, stats, amax_s, amax_o = g.sdpa_fp8(tq, tk, tv, *sc, is_inference=False, attn_scale=1 / math.sqrt(d),
                                          use_causal_mask=causal, name="sdpa")
    o.set_output(True).set_dim(qd).set_stride(qs).set_data_type(out_type)
    stats.set_output(True).set_data_type(FL)
    for a in (amax_s, amax_o): a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(FL)
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support(); g.build_plans()
    O = torch.empty(q.shape, device="cuda", dtype=torch.float8_e4m3fn if out_type == E4 else torch.bfloat16)
    S = torch.empty(bb, h, s, 1, device="cuda"); A1, A2 = one(), one()
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    pack = {tq: q, tk: k, tv: v, o: O, stats: S, amax_s: A1, amax_o: A2}
    scales = [one() for _ in sc]
    scales[4].fill_(448.0)  # scale_s: P in [0, 1] onto E4M3's range
    scales[3].fill_(1 / 448.0)  # descale_s
    for t, x in zip(sc, scales): pack[t] = x
    return (lambda: g.execute(pack, ws, handle=handle)), O, S
def bwd_graph(q, k, v, O, S, dO, causal, dq_type):
    g, (tq, tk, tv), (qd, qs), (kd, ks) = new_graph(q, k)
    bb, s, h, d = q.shape
    to = g.tensor(name="o", dim=qd, stride=qs, data_type=E4 if O.dtype == torch.float8_e4m3fn else BF)
    tdo = g.tensor(name="do", dim=qd, stride=qs, data_type=E5 if dO.dtype == torch.float8_e5m2 else E4)
    tst = g.tensor(name="st", dim=(bb, h, s, 1), stride=(h * s, s, 1, 1), data_type=FL)
    names = ("dq", "dk", "dv", "do_", "ddo", "ds", "ddp", "ss", "sdq", "sdk", "sdv", "sdp")
    sc = [g.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=FL) for n in names]
    outs = g.sdpa_fp8_backward(tq, tk, tv, to, tdo, tst, *sc, attn_scale=1 / math.sqrt(d), use_causal_mask=causal, name="bwd")
    dQ, dK, dV = outs[:3]
    tdt = {torch.bfloat16: BF, torch.float8_e5m2: E5, torch.float8_e4m3fn: E4}[dq_type]
    for t, dd, ss in ((dQ, qd, qs), (dK, kd, ks), (dV, kd, ks)): t.set_output(True).set_dim(dd).set_stride(ss).set_data_type(tdt)
    for a in outs[3:]: a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(FL)
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support(); g.build_plans()
    gq, gk, gv = torch.empty(q.shape, device="cuda", dtype=dq_type), torch.empty(k.shape, device="cuda", dtype=dq_type), torch.empty(v.shape, device="cuda", dtype=dq_type)
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    pack = {tq: q, tk: k, tv: v, to: O, tdo: dO, tst: S, dQ: gq, dK: gk, dV: gv}
    for a in outs[3:]: pack[a] = one()
    for t in sc: pack[t] = one()
    pack[sc[5]].fill_(1 / 448.0)  # descale_s, as in the forward
    pack[sc[7]].fill_(448.0)  # scale_s
    return lambda: g.execute(pack, ws, handle=handle)
def torch_best(qb, kb, vb, causal, bwd):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    res = {}
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([be]):
                gqa = kb.shape[1] != qb.shape[1]
                if not bwd:
                    f = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=gqa)
                else:
                    qr, kr, vr = (t.detach().requires_grad_() for t in (qb, kb, vb))
                    go = torch.randn_like(qb)
                    f = lambda: F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, enable_gqa=gqa).backward(go)
                res[be.name] = bench(f)
        except Exception as e:
            res[be.name] = None
    return res
for (bb, s, h, hk, d, causal) in ((2, 4096, 16, 16, 128, True), (2, 4096, 32, 8, 128, True), (1, 8192, 16, 4, 128, True), (4, 2048, 16, 4, 128, False)):
    print(f"== b{bb} s{s} h{h} hkv{hk} d{d} causal={causal}", flush=True)
    torch.manual_seed(0)
    qf, kf, vf = torch.randn(bb, s, h, d, device="cuda"), torch.randn(bb, s, hk, d, device="cuda"), torch.randn(bb, s, hk, d, device="cuda")
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (qf, kf, vf))
    qb, kb, vb = (t.to(torch.bfloat16).transpose(1, 2) for t in (qf, kf, vf))
    tf = torch_best(qb, kb, vb, causal, False); tb = torch_best(qb, kb, vb, causal, True)
    print("  torch bf16 fwd ms", tf, " fwd+bwd ms", tb, flush=True)
    fl = 4 * bb * h * s * s * d / (2 if causal else 1)
    for ot in (BF, E4):
        try:
            run, O, S = fwd_graph(q8, k8, v8, causal, ot)
            t = bench(run)
            best = min(x for x in tf.values() if x)
            print(f"  cudnn fp8 fwd (O {ot}): {t:.3f} ms  {fl / t / 1e9:.0f} TFLOP/s  x{best / t:.2f} of torch's best", flush=True)
            # accuracy vs fp32 reference on the same FP8 inputs (first batch, causal)
            ref = F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q8, k8, v8)), is_causal=causal, enable_gqa=h != hk).transpose(1, 2)
            o16 = F.scaled_dot_product_attention(*(x.to(torch.bfloat16).transpose(1, 2) for x in (q8, k8, v8)), is_causal=causal, enable_gqa=h != hk).transpose(1, 2)
            rms = lambda e: e.pow(2).mean().sqrt().item()  # noqa: E731
            print(f"    O error vs float64 (same FP8 inputs): rms {rms(O.double() - ref) / rms(ref):.4f} of rms(O), "
                  f"max {(O.double() - ref).abs().max().item():.4f}; bf16 SDPA: rms {rms(o16.double() - ref) / rms(ref):.4f}, "
                  f"max {(o16.double() - ref).abs().max().item():.4f}", flush=True)
            for dqt in (torch.bfloat16, torch.float8_e5m2):
                try:
                    dO = torch.randn(bb, s, h, d, device="cuda").to(torch.float8_e5m2)
                    O8 = O if O.dtype == torch.float8_e4m3fn else O.to(torch.float8_e4m3fn)
                    rb = bwd_graph(q8, k8, v8, O8, S, dO, causal, dqt)
                    tbw = bench(rb); bestb = min(x for x in tb.values() if x)
                    print(f"  cudnn fp8 bwd (dQKV {dqt}): {tbw:.3f} ms; fwd+bwd {t + tbw:.3f} ms  x{bestb / (t + tbw):.2f} of torch's best fwd+bwd", flush=True)
                    break
                except Exception as e:
                    print(f"  bwd dQKV {dqt} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        except Exception as e:
            print(f"  fwd O {ot} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
