"""What each rank runs in tests/test_distributed.py: spawned processes on a
gloo group, each writing its result (or its exception) to OUTDIR/rank<r>.pt."""
import datetime
import os
import time

import torch
import torch.distributed as dist

import hostembed
import hostembed.distributed as hd

ROWS, DIM, BATCH, STEPS = 600, 8, 64, 8
OPTIMIZERS = {
    "SGD": (hostembed.SGD, dict(lr=0.1)),
    "SparseAdam": (hostembed.SparseAdam, dict(lr=0.01)),
    "RowWiseAdagrad": (hostembed.RowWiseAdagrad, dict(lr=0.1)),
    # Steps every row: with weight decay, a row stepped twice would show.
    "Adam": (hostembed.Adam, dict(lr=0.01, weight_decay=0.1)),
    # Compact state: 8-bit exp_avg codes and scales, a second moment a row.
    "SparseAdamInt8": (hostembed.SparseAdam, dict(lr=0.01, state_dtype=torch.int8, rowwise_exp_avg_sq=True)),
}


def raised(kind, call, *args):
    """The message of the `kind` exception call(*args) raises, or None."""
    try:
        call(*args)
    except kind as exc:
        return str(exc)
    return None


def initial_table():
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))


def batch(step, rank):
    """Rank `rank`'s ids and target at `step`: Zipf-skewed ids, so ranks
    share their hot rows."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    weights = torch.arange(1, ROWS + 1, dtype=torch.float64).pow(-1.1)
    ids = torch.multinomial(weights, BATCH, replacement=True, generator=gen).view(8, -1)
    return ids, torch.randn(*ids.shape, DIM, generator=gen)


def train(rank, world, optimizer, fused, directory=None):
    """Steps on each rank's batches; with `directory`, each rank's shard
    kept on disk there (a row cache of 40 rows), flushed at the end."""
    on_disk = {} if directory is None else dict(storage=directory, cache_rows=40)
    emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False, **on_disk)
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(emb.parameters(), fused=fused, **hyper)
    for step in range(STEPS):
        ids, target = batch(step, rank)
        (emb(ids) - target).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    if directory is not None:
        emb.shard.flush_cache()
    state = {key: torch.as_tensor(value).clone() for key, value in opt.state[emb.shard.weight].items()
             if torch.is_tensor(value) and value.dim() > 0}
    return {"range": emb.row_range, "weight": emb.shard.weight.detach().clone(), "state": state,
            "fetches": None if directory is None else emb.shard.cache_stats["fetches"]}


def reopen_on_disk(rank, world, directory):
    emb = hd.ShardedEmbedding(ROWS, DIM, storage=directory, cache_rows=10)
    return {"range": emb.row_range, "weight": emb.shard.weight.detach().clone()}


def bags(step, rank):
    """Rank `rank`'s bags at `step`: (2-D ids, mean) or (1-D ids with
    offsets, include_last_offset, per-sample weights, sum), the ids
    Zipf-skewed, with padding id 5 among them; and the pooled target."""
    ids, target = batch(step, rank)
    gen = torch.Generator().manual_seed(7000 + 1000 * step + rank)
    flat = ids.reshape(-1)
    flat[::9] = 5
    # 8 bags cut at random points (some may be empty); the last offset ends the ids.
    cuts = torch.sort(torch.randint(0, flat.numel() + 1, (7,), generator=gen)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([flat.numel()])])
    weights = torch.rand(flat.numel(), generator=gen)
    return ids, flat, offsets, weights, target[:, 0], torch.randn(8, DIM, generator=gen)


def train_bags(rank, world, optimizer, fused, mode):
    """ShardedEmbeddingBag, padding_idx 5, trained on this rank's bags."""
    last = mode == "sum"
    emb = hd.ShardedEmbeddingBag.from_pretrained(initial_table(), freeze=False, mode=mode, padding_idx=5,
                                                 include_last_offset=last)
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(emb.parameters(), fused=fused, **hyper)
    for step in range(STEPS):
        ids, flat, offsets, weights, target, target_last = bags(step, rank)
        out = emb(flat, offsets, weights) if last else emb(ids)
        (out - (target_last if last else target)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    state = {key: torch.as_tensor(value).clone() for key, value in opt.state[emb.shard.weight].items()
             if torch.is_tensor(value) and value.dim() > 0}
    return {"range": emb.row_range, "weight": emb.shard.weight.detach().clone(), "state": state}


def train_host_sharded(rank, world, optimizer, bag, fused):
    """Rows sharded over 2 played hosts (ranks 2h and 2h + 1 on host h),
    each host's rows one copy its two ranks share; then an id out of range
    on the last rank."""
    host = f"host{rank // 2}"
    if bag:
        emb = hd.ShardedEmbeddingBag.from_pretrained(initial_table(), freeze=False, mode="sum",
                                                     share_within_host=True, _host=host)
    else:
        emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False, share_within_host=True, _host=host)
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(emb.parameters(), **({"fused": True} if fused else {}), **hyper)
    for step in range(STEPS):
        ids, target = batch(step, rank)
        (emb(ids) - (target.sum(1) if bag else target)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    weight = emb.shard.table.weight
    dist.barrier()  # the last updates done before the rows are read
    start, end = emb.shard.row_range
    state = {key: torch.as_tensor(value)[start:end].clone() for key, value in opt.state[weight].items()
             if torch.is_tensor(value) and value.dim() > 0}
    message = raised(IndexError, emb, torch.tensor([[3, ROWS + 7]]) if rank == world - 1 else torch.tensor([[1, 2]]))
    return {"rows": emb.row_range, "own": (emb.row_range[0] + start, emb.row_range[0] + end),
            "weight": weight.detach().clone(), "state": state, "mapping": _mapping_of(weight.data_ptr()),
            "message": message}


def uneven_hosts(rank, world):
    return {"message": raised(ValueError, lambda: hd.ShardedEmbedding(
        ROWS, DIM, share_within_host=True, _host="host0" if rank < 2 else "host1"))}


def out_of_range(rank, world):
    emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False)
    before = emb.shard.weight.detach().clone()
    message = raised(IndexError, emb, torch.tensor([3, ROWS + 5]) if rank == world - 1 else torch.tensor([1, 2]))
    # The group still works: a good batch after the refused one.
    good = emb(torch.tensor([rank, ROWS - 1 - rank]))
    return {"message": message, "unchanged": torch.equal(before, emb.shard.weight.detach()),
            "good": torch.equal(good, initial_table()[[rank, ROWS - 1 - rank]])}


def mismatched(rank, world):
    return {"message": raised(ValueError, hd.ShardedEmbedding, ROWS, DIM + rank)}


class _Model(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.emb = getattr(hd, kind).from_pretrained(initial_table(), freeze=False)
        self.dense = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.dense(self.emb(ids)).squeeze(-1)


def with_ddp(rank, world, kind):
    """A sharded table and a dense layer under DDP: the dense gradient is
    averaged over the ranks, the table kept out of the all-reduce (DDP
    cannot reduce a sparse gradient whose rows differ by rank anyway)."""
    torch.manual_seed(0)
    model = _Model(kind)
    hd.exclude_from_ddp(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ids, target = batch(0, rank)
    (ddp(ids) - target[..., 0]).pow(2).sum().backward()
    # This rank's own dense gradient, without DDP, for the test to average.
    alone = _Model(kind)
    alone.load_state_dict(model.state_dict())
    (alone(ids) - target[..., 0]).pow(2).sum().backward()
    table = model.emb.shard if kind.startswith("Sharded") else model.emb.table
    table_alone = alone.emb.shard if kind.startswith("Sharded") else alone.emb.table
    return {"dense_grad": model.dense.weight.grad.clone(), "own_dense_grad": alone.dense.weight.grad.clone(),
            "ignored": sorted(ddp.parameters_to_ignore),
            # The table's gradient is the same with DDP as without: DDP did not average it.
            "table_grad_same": torch.equal(table.weight.grad.to_dense(), table_alone.weight.grad.to_dense())}


def global_batch(step):
    """Step `step`'s ids and targets for all ranks together; rank r of W
    takes its 1/W of them (so any number of ranks trains on the same)."""
    gen = torch.Generator().manual_seed(500 + step)
    weights = torch.arange(1, ROWS + 1, dtype=torch.float64).pow(-1.1)
    ids = torch.multinomial(weights, 96, replacement=True, generator=gen)
    return ids, torch.randn(96, DIM, generator=gen)


class _Tables(torch.nn.Module):
    """A model around one table over the ranks: "sharded" (each rank its
    rows), "shared" (one copy for all), or "hosts" (rows over played hosts
    of `per_host` ranks each, each host's rows shared by its ranks)."""

    def __init__(self, kind="sharded", per_host=1):
        super().__init__()
        rank = dist.get_rank()
        if kind == "shared":
            self.emb = hd.SharedEmbedding.from_pretrained(initial_table(), freeze=False)
        else:
            self.emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False,
                                                           share_within_host=kind == "hosts",
                                                           _host=f"host{rank // per_host}")

    def own(self, opt):
        """(the rows of the table this rank updates, their weights, their
        optimizer state, its step)."""
        emb = self.emb
        if isinstance(emb, hd.SharedEmbedding):
            weight, first, (start, end) = emb.table.weight, 0, emb.row_range
        elif isinstance(emb.shard, hd.SharedEmbedding):
            weight, first = emb.shard.table.weight, emb.row_range[0]
            start, end = (first + r for r in emb.shard.row_range)
        else:
            weight, first, (start, end) = emb.shard.weight, emb.row_range[0], emb.row_range
        dist.barrier()  # every rank's last update done
        state = opt.state[weight]
        rows = slice(start - first, end - first)
        return {"range": (start, end), "weight": weight.detach()[rows].clone(),
                **{key: value[rows].clone() for key, value in state.items() if key != "step"},
                "step": int(state["step"])}


def _train_steps(model, opt, steps, rank, world, slow_rank=None):
    """slow_rank: that rank steps a moment late (nothing orders the ranks'
    steps against another rank's save)."""
    for step in steps:
        ids, target = (t.tensor_split(world)[rank] for t in global_batch(step))
        (model.emb(ids) - target).pow(2).sum().backward()
        if rank == slow_rank:
            time.sleep(0.3)
        opt.step()
        opt.zero_grad()


def reshard(rank, world, checkpoints, written_by, kind="sharded", per_host=1, optimizer="SparseAdam"):
    """Trains 3 steps and saves a checkpoint a rank (written_by 0), or
    loads the checkpoints `written_by` ranks saved; then 2 more steps."""
    model = _Tables(kind, per_host)
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **hyper)
    refused = None
    if written_by and kind != "sharded" and world != written_by:
        # Another layout's file: hostembed.load refuses it, nothing loaded
        # (the ranks in step: no rank's load writes shared rows meanwhile).
        dist.barrier()
        if rank < written_by:
            before = [t.detach().clone() for t in model.state_dict().values() if torch.is_tensor(t)]
            refused = raised(RuntimeError, hostembed.load, os.path.join(checkpoints, f"rank{rank}.pt"), model, opt)
            after = [t for t in model.state_dict().values() if torch.is_tensor(t)]
            refused = (refused, all(torch.equal(a, b) for a, b in zip(before, after)) and not opt.state)
        dist.barrier()
    if written_by == world and kind != "sharded":
        # The same layout: each rank loads its own file, and of a shared
        # table only the rows it updates.
        hostembed.load(os.path.join(checkpoints, f"rank{rank}.pt"), model, opt)
    elif written_by:
        hd.load_resharded([os.path.join(checkpoints, f"rank{r}.pt") for r in range(written_by)], model, opt)
    else:
        # The last rank's last update still running as the others save: a
        # shared table's file holds its rows mid-update, which no load may take.
        _train_steps(model, opt, range(3), rank, world, slow_rank=world - 1)
        hostembed.save(os.path.join(checkpoints, f"rank{rank}.pt"), model, opt)
    _train_steps(model, opt, range(3, 5), rank, world)
    return dict(model.own(opt), refused=refused)


def from_single_process(rank, world, plain, directory, kind="sharded", per_host=1):
    """Loads a single process's checkpoint (a plain table) into the ranks;
    the rows and state as loaded, then two steps and a checkpoint a rank."""
    model = _Tables(kind, per_host)
    opt = hostembed.SparseAdam(model.parameters(), lr=0.01)
    hd.load_resharded([plain], model, opt)
    loaded = model.own(opt)
    _train_steps(model, opt, range(3, 5), rank, world)
    hostembed.save(os.path.join(directory, f"rank{rank}.pt"), model, opt)
    return dict(model.own(opt), loaded=loaded)


def load_foreign(rank, world, directory):
    model = _Tables()
    before = model.emb.shard.weight.detach().clone()
    message = raised(ValueError, hd.load_resharded, [os.path.join(directory, f"rank{r}.pt") for r in range(3)], model)
    return {"message": message, "unchanged": torch.equal(before, model.emb.shard.weight.detach())}


def rank_dies(rank, world):
    """The last rank exits in the middle of training; the others must fail
    with an error (gloo sees the closed connection), not wait forever."""
    emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False)
    emb(torch.tensor([rank])).sum().backward()
    if rank == world - 1:
        os._exit(3)
    started = time.monotonic()
    try:
        emb(torch.tensor([rank, 5])).sum().backward()
    except RuntimeError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - started}
    return {"message": None, "seconds": time.monotonic() - started}


def _mapping_of(address):
    """(perms, inode, path) of the mapping of this process holding `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[1], int(fields[4]), fields[5].strip() if len(fields) > 5 else ""
    return None


def _private_kib():
    """This process's private resident memory (KiB)."""
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:")))


def _smaps_of(address):
    """The /proc/self/smaps fields (KiB) of the mapping holding `address`."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and len(head) == 3 and head[2] == "kB":
                fields[head[0].rstrip(":")] = int(head[1])
    return fields


def shared_memory(rank, world, rows, dim):
    """A rows x dim SharedEmbedding whose every row each rank reads: what
    the table's mapping holds in this process, and how much private memory
    the rank gained building and reading it."""
    before = _private_kib()
    emb = hd.SharedEmbedding(rows, dim)
    with torch.no_grad():
        for chunk in torch.arange(rows).split(rows // 10):
            emb(chunk)
    dist.barrier()  # every rank has read every row
    return {"mapping": _smaps_of(emb.table.weight.data_ptr()), "private_gain_kib": _private_kib() - before}


def train_shared(rank, world, optimizer, fused):
    """A shared table trained by every rank; with fused=True, an unfused
    twin trained on the same batches beside it."""
    cls, hyper = OPTIMIZERS[optimizer]
    pairs = []
    for twin_fused in (fused, False) if fused else (False,):
        emb = hd.SharedEmbedding.from_pretrained(initial_table(), freeze=False)
        pairs.append((emb, cls(emb.parameters(), **({"fused": True} if twin_fused else {}), **hyper)))
    for step in range(STEPS):
        ids, target = batch(step, rank)
        for emb, opt in pairs:
            (emb(ids) - target).pow(2).sum().backward()
            if fused and opt is pairs[0][1]:
                assert emb.table.weight.grad is None, "a fused update left a gradient"
            opt.step()
            opt.zero_grad()
    dist.barrier()  # the last updates done before the table is read
    emb, opt = pairs[0]
    start, end = emb.row_range
    state = {key: torch.as_tensor(value)[start:end].clone() for key, value in opt.state[emb.table.weight].items()
             if torch.is_tensor(value) and value.dim() > 0}
    return {"range": emb.row_range, "table": emb.table.weight.detach().clone(), "state": state,
            "mapping": _mapping_of(emb.table.weight.data_ptr()),
            "unfused_table": pairs[-1][0].table.weight.detach().clone()}


def on_device(rank, world, kind, backend):
    """A table over the ranks with outputs on the GPU ("sharded", "shared",
    or "bags": ShardedEmbeddingBag in sum mode), its traffic through
    `backend` (a group of its own: "gloo" or "nccl"); SparseAdam, fused
    for the shared table. What each rank owns after training, the device
    its outputs were on, and (shared) the path its lookups took."""
    torch.cuda.set_device(0)
    group = dist.new_group(list(range(world)), backend=backend)
    common = dict(freeze=False, process_group=group, device="cuda")
    if kind == "shared":
        emb = hd.SharedEmbedding.from_pretrained(initial_table(), **common)
    elif kind == "bags":
        emb = hd.ShardedEmbeddingBag.from_pretrained(initial_table(), mode="sum", **common)
    else:
        emb = hd.ShardedEmbedding.from_pretrained(initial_table(), **common)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.01, fused=kind == "shared")
    devices = set()
    for step in range(STEPS):
        ids, target = batch(step, rank)
        out = emb(ids)
        devices.add(str(out.device))
        (out - (target.sum(1) if kind == "bags" else target).cuda()).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier(group=group)
    if kind == "shared":
        weight, first, (start, end) = emb.table.weight, 0, emb.row_range
    else:
        weight, first, (start, end) = emb.shard.weight, emb.row_range[0], emb.row_range
    state = opt.state[weight]
    rows = slice(start - first, end - first)
    return {"range": (start, end), "weight": weight.detach()[rows].clone(), "devices": sorted(devices),
            "exp_avg": state["exp_avg"][rows].clone(),
            "path": emb.table._last_lookup_path if kind == "shared" else None}


def moves_and_casts(rank, world):
    """ShardedEmbedding's .double() converts its shard and keeps the
    outputs on the CPU; device="cuda" without CUDA is refused."""
    emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False).double()
    ids = torch.tensor([1, ROWS - 2])
    out = emb(ids)
    no_cuda = None if torch.cuda.is_available() else raised(RuntimeError, lambda: hd.ShardedEmbedding(
        ROWS, DIM, device="cuda"))
    # One rank looks up its own rows without the exchange, and still
    # names a bad id the way the ranks do.
    bad = raised(IndexError, emb, torch.tensor([4, ROWS + 3]))
    return {"dtype": str(out.dtype), "device": str(out.device), "shard": str(emb.shard.weight.dtype),
            "equal": torch.equal(out, initial_table().double()[ids]), "no_cuda": no_cuda, "bad": bad}


def shared_refusals(rank, world):
    out = {"hosts": raised(ValueError, lambda: hd.SharedEmbedding(ROWS, DIM, _host=f"host{rank}"))}
    emb = hd.SharedEmbedding.from_pretrained(initial_table(), freeze=False)
    address = emb.table.weight.data_ptr()
    out["cast"] = raised(RuntimeError, emb.half)
    out["unchanged"] = (emb.table.weight.dtype == torch.float32 and emb.table.weight.data_ptr() == address
                        and torch.equal(emb.table.weight.detach(), initial_table()))
    return out


def shared_out_of_range(rank, world):
    """A bad id on the last rank of a SharedEmbedding, every rank staying
    alive: each raises in forward (none waits in backward's exchange), no
    row changes, and the group trains on."""
    emb = hd.SharedEmbedding.from_pretrained(initial_table(), freeze=False)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([rank, 5])).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    dist.barrier()
    before = emb.table.weight.detach().clone()
    ids = torch.tensor([3, ROWS + 5]) if rank == world - 1 else torch.tensor([1, 2])
    message = raised(IndexError, lambda: emb(ids).pow(2).sum().backward())
    dist.barrier()
    unchanged = torch.equal(before, emb.table.weight.detach())
    emb(torch.tensor([rank, 7])).pow(2).sum().backward()
    opt.step()
    dist.barrier()
    return {"message": message, "unchanged": unchanged,
            "trained": not torch.equal(before[7], emb.table.weight.detach()[7])}


JOBS = {"train": train, "out_of_range": out_of_range, "mismatched": mismatched, "with_ddp": with_ddp,
        "reshard": reshard, "load_foreign": load_foreign, "rank_dies": rank_dies,
        "train_shared": train_shared, "shared_refusals": shared_refusals, "train_bags": train_bags,
        "train_host_sharded": train_host_sharded, "uneven_hosts": uneven_hosts,
        "shared_memory": shared_memory, "on_device": on_device, "moves_and_casts": moves_and_casts,
        "from_single_process": from_single_process, "shared_out_of_range": shared_out_of_range,
        "train_on_disk": train, "reopen_on_disk": reopen_on_disk}


def worker(rank, world, outdir, job, args):
    torch.set_num_threads(1)
    hostembed.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = JOBS[job](rank, world, *args)
        if job != "rank_dies":  # its peer is gone
            dist.barrier()  # every rank's collectives done
    except Exception as exc:  # reported to the test, which fails with it
        result = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    # Out at once, without tearing the group down: on torch 2.13 a gloo
    # group's teardown aborts a process now and then ("terminate called
    # without an active exception", seen in CI), after its work is done.
    os._exit(0)

