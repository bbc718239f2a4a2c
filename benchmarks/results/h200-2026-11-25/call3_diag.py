import sys
import torch, hostembed
import torch.nn.functional as F
sys.path.insert(0, "benchmarks")
import gpu_sanitize as gs
check = "check" in sys.argv
gen = torch.Generator().manual_seed(0)
for dim in (13,):
    for kwargs in ({},):
        torch.manual_seed(0)
        emb = hostembed.Embedding(700, dim, device="cuda", **kwargs)
        opt = hostembed.SparseAdam(emb.parameters(), lr=0.01, update="gpu")
        t = emb._table
        for step in range(3):
            ids = gs.zipf(700, 3000, gen)
            ids = ids.to(torch.int32) if step == 1 else ids
            ids = ids.cuda() if step != 2 else ids
            out = emb(ids)
            if check:
                print("equal", torch.equal(out, F.embedding(ids.cuda(), emb.weight.detach().cuda())))
            out.backward(torch.randn(out.shape, generator=gen).cuda())
            tw = t.grad_twin
            gr = emb.weight.grad
            why = None
            if tw is not None:
                why = dict(ver=gr._version, nnz=(gr._nnz(), tw.nnz),
                           iptr=gr._indices().data_ptr() == tw.indices_ptr, vptr=gr._values().data_ptr() == tw.values_ptr)
            ready = opt._gpu_ready(emb.weight, t, *(opt.state[emb.weight][k] for k in ("exp_avg", "exp_avg_sq"))) if opt.state.get(emb.weight) else "nostate"
            opt.step(); opt.zero_grad()
            print("check" if check else "", step, ids.device, emb._last_lookup_path, "pinned", emb.weight.is_pinned(), "wanted", t.twin_wanted, "twin", tw is not None, why, "ready", ready, "->", opt._last_update, flush=True)
gs.fused_and_cached(gen)
print("fused_and_cached problems:", gs.PROBLEMS)
