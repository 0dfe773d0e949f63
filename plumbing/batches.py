"""
Batches: which rows make a batch and how it is collated ahead of the step (how the gradient cache cuts one, the
Layout, is the model's: modeling_xprt.py).
  1. the samplers: length-grouped batches as a function of (seed, epoch), one document's groups capped per batch,
     no repeated query (fine-tuning); the in-batch negatives the same-document mask leaves; train.py's batches
     for a loop of one's own (document_batches)
  2. the loader: batches collated in DataLoader workers, their random draws seeded by the batch's place in the run
     (SeededCollate), so a resumed run draws what the uninterrupted one drew; the batch to the device
It imports plumbing/common.py, and modeling_xprt.py's document hash (the id L_xp masks by).
"""

from __future__ import annotations

import array
import os
import random
import signal
from typing import Optional

import numpy as np
import torch

from plumbing.common import STOP_SIGNALS, UserError

# ==============================================================================================================
# 1. Which rows make a batch: the samplers
# ==============================================================================================================

class LengthGroupedBatchSampler(torch.utils.data.Sampler):
    """Batches of similar length, in a random order that depends only on (seed, epoch).

    Shuffle, cut into mega-batches of 50 batches, sort each by length, cut into batches, shuffle the batches;
    incomplete last batches dropped. A function of (seed, epoch), so a resume's skip_first_batches lands right.
    `to_batches` turns the epoch's order into batches (NoDuplicatesBatchSampler overrides it). spread > 1 deals each
    run of `spread` length-sorted batches round-robin, so one document's groups land in different batches.
    keys and max_per_key cap the rows of one key in any batch (docs/plumbing.md: LengthGroupedBatchSampler); rows
    beyond the cap wait out the epoch, counted in rows_left_out."""

    def __init__(self, lengths, batch_size: int, seed: int, group_by_length: bool = True, mega: int = 50,
                 spread: int = 1, keys=None, max_per_key: int = 0):
        # kept as a numpy int64 array (docs/plumbing.md: LengthGroupedBatchSampler). A callable epoch -> lengths: the
        # random-span baseline's crops (crop_spans); (N, 2) lengths: two views padded separately (batch_matrix)
        self.lengths_for_epoch = lengths if callable(lengths) else None
        lengths = lengths(0) if callable(lengths) else lengths
        self.lengths, self.batch_size, self.seed = np.asarray(lengths, dtype=np.int64), batch_size, seed
        self.group, self.mega, self.spread = group_by_length, mega, spread
        self.epoch, self.drop_last = 0, True
        if len(self.lengths) < batch_size:
            raise UserError(f"{len(self.lengths)} examples cannot fill one batch of {batch_size}: lower "
                            "--per_device_train_batch_size")
        self.keys = None if keys is None or max_per_key < 1 else np.asarray(keys)  # (N,) e.g. document id hashes
        self.max_per_key, self.num_batches = max_per_key, len(self.lengths) // batch_size
        if self.keys is not None:
            if len(self.keys) != len(self.lengths):
                raise ValueError(f"{len(self.keys)} keys for {len(self.lengths)} examples")
            counts = np.unique(self.keys, return_counts=True)[1]
            self.num_batches = capped_batch_count(counts, batch_size, max_per_key)
            if self.num_batches == 0:
                raise UserError(f"no batch of {batch_size} holds at most {max_per_key} groups of one document: the "
                                f"data has {len(counts)} document(s) for {len(self.lengths)} groups; raise "
                                "--max_document_groups_per_batch or select from more documents")
        # rows a full epoch leaves out because of the cap (the incomplete last batch aside)
        self.rows_left_out = (len(self.lengths) // batch_size - self.num_batches) * batch_size

    def set_epoch(self, epoch: int):
        if self.lengths_for_epoch is not None and epoch != self.epoch:
            self.lengths = np.asarray(self.lengths_for_epoch(epoch), dtype=np.int64)
        self.epoch = epoch

    def batch_matrix(self) -> np.ndarray:
        """The epoch's batches as a (batches, batch_size) int64 array of row indices. The draws: random.shuffle of
        range(n) (an array.array), a *stable* sort by -length inside each mega-batch, then random.shuffle of the list
        of batch numbers (docs/plumbing.md: batch_matrix)."""
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        n, bs = len(self.lengths), self.batch_size
        order = array.array("q", range(n))
        rng.shuffle(order)
        order = np.frombuffer(order, dtype=np.int64)  # a view: no copy
        if self.group:
            span = bs * self.mega
            for s in range(0, n, span):
                part = order[s:s + span]
                part = part[self._longest_first(self.lengths[part])]
                order[s:s + span] = self._deal(part, bs)
        batches = self.to_batches(order)
        perm = list(range(n // bs))
        rng.shuffle(perm)
        batches = batches[perm]
        if self.keys is None or (self.num_batches == len(batches) and not self.over_cap(batches)):
            return batches
        return self._capped_batches()

    def over_cap(self, batches: np.ndarray) -> bool:
        """Whether some batch holds more than max_per_key rows of one key."""
        k, c = np.sort(self.keys[batches], axis=1), self.max_per_key
        return c < k.shape[1] and bool((k[:, c:] == k[:, :-c]).any())  # c + 1 equal keys in a sorted row

    def _capped_batches(self) -> np.ndarray:
        """num_batches batches with at most max_per_key rows of a key each, drawn from (seed, epoch).

        A key keeps a random max_per_key * num_batches of its rows, trimmed to num_batches * batch_size, length-grouped
        and cut in order; before each batch a key with r rows left and R batches to go gives the
        max(0, r - max_per_key * (R - 1)) it must, so every batch fills (docs/plumbing.md: _capped_batches)."""
        from collections import deque

        rng = np.random.default_rng([self.seed, self.epoch, 1])
        bs, nb, cap = self.batch_size, self.num_batches, self.max_per_key
        order = rng.permutation(len(self.lengths))
        by_key = np.argsort(self.keys[order], kind="stable")
        keys_sorted = self.keys[order][by_key]
        rank = np.empty(len(order), dtype=np.int64)
        rank[by_key] = np.arange(len(order)) - np.searchsorted(keys_sorted, keys_sorted, side="left")
        order = order[rank < cap * nb][: nb * bs]  # a key's first cap * nb rows of the epoch's order; nb * bs in all
        if self.group:
            span = bs * self.mega
            for s in range(0, len(order), span):
                part = order[s:s + span]
                order[s:s + span] = self._deal(part[self._longest_first(self.lengths[part])], bs)
        keys = self.keys[order].tolist()  # position -> key
        left = {}
        for k in keys:
            left[k] = left.get(k, 0) + 1
        heavy = sorted((k for k in left if left[k] > cap), key=lambda k: -left[k])  # the keys that can be forced
        positions = {k: deque() for k in heavy}
        for pos, k in enumerate(keys):
            if k in positions:
                positions[k].append(pos)
        used, nxt, waiting, out = np.zeros(len(order), dtype=bool), 0, deque(), []
        for to_go in range(nb, 0, -1):
            batch, held = [], {}

            def take(pos):
                used[pos] = True
                batch.append(pos)
                held[keys[pos]] = held.get(keys[pos], 0) + 1
                left[keys[pos]] -= 1

            for k in heavy:  # rows that cannot wait
                if left[k] <= cap * (to_go - 1):
                    continue
                while left[k] > cap * (to_go - 1):
                    pos = positions[k].popleft()
                    if not used[pos]:
                        take(pos)
            skipped = deque()
            while len(batch) < bs:
                if waiting:
                    pos = waiting.popleft()
                else:
                    pos, nxt = nxt, nxt + 1
                if used[pos]:
                    continue
                if held.get(keys[pos], 0) == cap:
                    skipped.append(pos)
                    continue
                take(pos)
            skipped.extend(waiting)
            waiting = skipped  # first in line for the next batch
            out.append(order[batch])
        out = np.asarray(out, dtype=np.int64).reshape(nb, bs)
        return out[rng.permutation(nb)]

    def _deal(self, part: np.ndarray, bs: int) -> np.ndarray:
        """A sorted mega-batch with each run of `spread` batches dealt round-robin (the last, shorter run over the
        batches it fills); consecutive batch_size blocks of the result are the batches."""
        if self.spread <= 1:
            return part
        w, out = bs * self.spread, part.copy()
        for s in range(0, len(part) // bs * bs, w):
            run = part[s:s + w]
            k = len(run) // bs  # full batches in this run
            out[s:s + k * bs] = run[:k * bs].reshape(bs, k).T.reshape(-1)  # batch j: rows j, j + k, j + 2k, ...
        return out

    @staticmethod
    def _longest_first(lengths, buckets: int = 10) -> np.ndarray:
        """Stable order, longest first. (N, 2) lengths [longer view, shorter view], two tensors each padded to its
        own longest: by the longer view, then, in each of `buckets` runs of it, by the shorter, so that both tensors
        of a batch are tight (docs/plumbing.md: _longest_first)."""
        if lengths.ndim == 1:
            return np.argsort(-lengths, kind="stable")
        order = np.argsort(-lengths[:, 0], kind="stable")
        return np.concatenate([p[np.argsort(-lengths[p, 1], kind="stable")] for p in np.array_split(order, buckets)])

    def to_batches(self, order: np.ndarray) -> np.ndarray:
        """The epoch's order -> (len(self), batch_size) batches: consecutive rows (the incomplete tail dropped)."""
        n, bs = len(order), self.batch_size
        return order[: (n // bs) * bs].reshape(n // bs, bs)

    def batches(self) -> list:
        return self.batch_matrix().tolist()

    def __iter__(self):
        # one batch at a time as a list of Python ints (what the DataLoader and accelerate's samplers expect)
        return (b.tolist() for b in self.batch_matrix())

    def __len__(self):
        return self.num_batches

class NoDuplicatesBatchSampler(LengthGroupedBatchSampler):
    """Length-grouped batches (batches.LengthGroupedBatchSampler) in which no two rows share a key (each row's query:
    sentence-transformers' NoDuplicatesBatchSampler rule). A query with several positives has several rows; in one
    batch, each would be the other's in-batch false negative."""

    def __init__(self, lengths, batch_size: int, seed: int, keys, group_by_length: bool = True):
        super().__init__(lengths, batch_size, seed, group_by_length)
        # not self.keys: the parent's per-batch cap reads that name (train.py's documents), which this rule replaces
        self.query_keys = list(keys)
        if len(self.query_keys) != len(self.lengths):
            raise ValueError(f"{len(self.query_keys)} keys for {len(self.lengths)} examples")

    def to_batches(self, order):
        """Cut `order` into len(self) full batches in which no key repeats, keeping close to the order (so to the
        length grouping): a repeated key trades places with a neighbour of the previous batch, else waits for the
        next batch. Deterministic in `order` (docs/plumbing.md: NoDuplicatesBatchSampler.to_batches)."""
        from collections import deque

        keys, bs = self.query_keys, self.batch_size
        queue, out = deque(order.tolist()), []

        def trade(i, b, held):  # put row i into earlier batch b for b's last row the current batch can take
            if keys[i] in {keys[j] for j in b}:
                return None
            pos = next((pos for pos in reversed(range(len(b))) if keys[b[pos]] not in held), None)
            if pos is None:
                return None
            b[pos], taken = i, b[pos]
            return taken

        while len(out) < len(self):
            batch, held, waiting = [], set(), []
            while queue and len(batch) < bs:
                i = queue.popleft()
                if keys[i] in held:
                    taken = trade(i, out[-1], held) if out else None
                    if taken is None:
                        waiting.append(i)
                        continue
                    i = taken
                batch.append(i)
                held.add(keys[i])
            for i in list(waiting):  # the queue ran dry (only near the end): trade with any earlier batch
                if len(batch) == bs:
                    break
                for b in reversed(out):
                    taken = trade(i, b, held)
                    if taken is not None:
                        waiting.remove(i)
                        batch.append(taken)
                        held.add(keys[taken])
                        break
            if len(batch) < bs:
                raise UserError(f"cannot cut {len(self.lengths)} rows into {len(self)} batches of {bs} without "
                                "repeating a key (a key with more rows than batches?): lower "
                                "--per_device_train_batch_size")
            out.append(batch)
            queue.extendleft(reversed(waiting))  # first in line for the next batch
        return np.asarray(out, dtype=np.int64).reshape(-1, bs)

def capped_batch_count(counts, batch_size: int, max_per_key: int) -> int:
    """The most batches of `batch_size` rows, at most `max_per_key` of one key each, that rows of these per-key
    `counts` fill: the largest B with sum_k min(count_k, max_per_key * B) >= batch_size * B (at most
    sum(counts) // batch_size). That sum minus batch_size * B is concave in B and 0 at B = 0, so the Bs that fit
    are 0..B*, found by bisection. E.g. one document with 2,095 groups and 24 others, batch 4, cap 2: 12 batches."""
    counts = np.asarray(counts, dtype=np.int64)
    lo, hi = 0, int(counts.sum()) // batch_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, max_per_key * mid).sum() >= batch_size * mid:
            lo = mid
        else:
            hi = mid - 1
    return lo

def document_keys(rows, chunk: int = 65536, positive: str = "s1") -> tuple:
    """Each group's document, for L_xp's same-document mask, the spread and the per-document cap: the connected
    components of groups linked by a shared doc_id or a shared anchor / positive-slot text (docs/plumbing.md:
    document_keys) -> (keys, merged): keys (groups,) int64, the code of the component's first doc_id in sorted
    order; merged {row: that doc_id} for the rows whose doc_id it replaces. Read `chunk` rows at a time."""
    import pyarrow.compute as pc
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    from modeling_xprt import stable_doc_hash

    ids, anchors, firsts = [], [], []
    for part in rows.with_format("arrow").iter(batch_size=chunk):
        ids += part.column("doc_id").to_pylist()
        anchors.append(np.fromiter(map(stable_doc_hash, part.column("anchor").to_pylist()), np.int64))
        slot = (part.column("random_passage") if positive == "random"
                else pc.list_element(part.column("related"), 0)).to_pylist()
        firsts.append(np.fromiter(map(stable_doc_hash, slot), np.int64))
    names, doc = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)
    n = len(doc)
    # a bipartite graph: the groups 0..n-1, then one node per distinct doc_id, then one per distinct text of either
    # role (one space: an anchor and another group's positive with the same text are one node)
    text = np.unique(np.concatenate(anchors + firsts), return_inverse=True)[1].reshape(-1) if n else doc
    text_nodes = text + n + (int(doc.max()) + 1 if n else 0)  # anchors' then positives' (2n,)
    cols = [doc.reshape(-1) + n, text_nodes[:n], text_nodes[n:]]
    offset = int(text_nodes.max()) + 1 if n else 0
    src = np.tile(np.arange(n), 3)
    graph = coo_matrix((np.ones(3 * n, dtype=np.int8), (src, np.concatenate(cols))), shape=(offset, offset))
    _, component = connected_components(graph, directed=False)
    first = np.full(component.max() + 1 if n else 0, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, component[:n], doc)
    keys = first[component[:n]]
    moved = np.flatnonzero(keys != doc)
    return keys, {int(i): str(names[keys[i]]) for i in moved}

def sampler_negatives(sampler: "LengthGroupedBatchSampler", keys) -> dict:
    """What the same-document mask leaves of one process's batches in epoch 0, exact, from the sampler alone (other
    processes' rows add to it): per row, the batch's rows with another key. -> {"mean", "min", "rows_without",
    "rows", "batch_size"}."""
    keys = np.asarray(keys)
    epoch = sampler.epoch
    sampler.set_epoch(0)
    k = keys[sampler.batch_matrix()]  # (batches, batch_size)
    sampler.set_epoch(epoch)
    # (batches, batch_size), 64 batches at a time: the (64, batch_size, batch_size) comparison stays small
    left = np.concatenate([(b[:, :, None] != b[:, None, :]).sum(2) for b in np.split(k, range(64, len(k), 64))]
                          or [np.zeros((0, sampler.batch_size), dtype=np.int64)])
    return {"mean": float(left.mean()) if left.size else 0.0, "min": int(left.min()) if left.size else 0,
            "rows_without": int((left == 0).sum()), "rows": int(left.size), "batch_size": sampler.batch_size}

def document_batches(groups, collator, batch_size: int, seed: int = 0, epoch: int = 0, spread: int = 16):
    """train.py's batches of the groups (a datasets.Dataset: train.load_groups) for a loop of one's own: lists of rows
    the collator takes, at most half a batch of one document's (document_keys), so L_xp keeps negatives."""
    lengths, extras = collator.sort_lengths(groups, seed)
    keys, merged = document_keys(groups, positive=getattr(collator, "positive", "s1"))
    sampler = LengthGroupedBatchSampler(lengths, batch_size, seed, spread=spread if collator.spread_documents else 1,
                                        keys=keys, max_per_key=max(batch_size // 2, 1))
    sampler.set_epoch(epoch)
    for batch in sampler:
        yield [with_extras(merged, extras, epoch, int(i), groups[int(i)]) for i in batch]

def with_extras(merged: dict, row_extras, epoch: int, i: int, row: dict) -> dict:
    """Row i as the collator reads it: under the doc_id its text copies share (merged: document_keys), with the
    objective's per-epoch extras (row_extras(epoch, i): the random-span baseline's crops)."""
    if i in merged:
        row = {**row, "doc_id": merged[i]}
    return {**row, **row_extras(epoch, i)} if row_extras is not None else row

def check_batch_fits(rows: int, batch_size: int, world: int, what: str, distinct: Optional[int] = None):
    """Refuse, before the work that builds them (fine-tuning mines its negatives first), data too small for one
    step: every process needs a full batch (incomplete batches are dropped), and a batch of fine-tuning holds each
    query once (`distinct`: the distinct queries)."""
    flag = "--per_device_train_batch_size"
    if rows < batch_size * world:
        raise UserError(f"{flag} {batch_size} x {world} process(es) needs {batch_size * world} {what} for one step; "
                        f"the data has {rows}: lower {flag}")
    if distinct is not None and distinct < batch_size:
        raise UserError(f"{flag} {batch_size}: a batch holds each query once, and the data has {distinct} distinct "
                        f"queries: lower {flag}")

# ==============================================================================================================
# 2. The loader: batches collated ahead of the step, seeded by their place in the run
# ==============================================================================================================

class RowsDataset(torch.utils.data.Dataset):
    """(key, row) pairs: rows as plain dicts from a list of dicts (fine-tuning) or a datasets.Dataset (the groups:
    memory-mapped Arrow, one row converted to a dict when the loader asks for it, so memory does not grow with the
    number of groups). key: a row index, or (epoch, batch number, row index) from KeyedBatches; the row index is the
    row's place in the data, which keys what is drawn per row (crops, negatives)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        return key, self.rows[key[-1] if isinstance(key, tuple) else key]

    def __getitems__(self, keys: list) -> list:
        """A whole batch in one read (the DataLoader's fetcher calls this when it exists): from an Arrow table, one
        take of the batch's rows (docs/plumbing.md: RowsDataset)."""
        if isinstance(self.rows, list):
            return [self.__getitem__(k) for k in keys]
        columns = self.rows[[k[-1] if isinstance(k, tuple) else k for k in keys]]
        return list(zip(keys, (dict(zip(columns, values)) for values in zip(*columns.values()))))

class KeyedBatches(torch.utils.data.Sampler):
    """A batch sampler's batches with every row index keyed by (epoch, batch number in the epoch): all a DataLoader
    worker needs to collate a batch as a pure function of its rows (SeededCollate). accelerate shards and skips these
    batches as it does the plain ones."""

    def __init__(self, sampler):
        self.batch_sampler = sampler
        self.batch_size, self.drop_last = sampler.batch_size, sampler.drop_last  # what accelerate's shards read

    def set_epoch(self, epoch: int):
        self.batch_sampler.set_epoch(epoch)

    def __iter__(self):
        epoch = self.batch_sampler.epoch
        return ([(epoch, n, i) for i in b] for n, b in enumerate(self.batch_sampler))

    def __len__(self):
        return len(self.batch_sampler)

class SeededCollate:
    """collate_fn of the training DataLoader: [((epoch, batch, row index), row)] -> the collator's batch.

    The collator's generator is re-seeded from (seed, epoch, batch, process): workers build batches in any order,
    and a resumed run draws what the uninterrupted one drew.
    make_row(epoch, row index, row) -> the row the collator reads (train.py: the random-span crops; finetune.py: the
    epoch's negatives); None: the row as stored."""

    def __init__(self, collator, seed: int, process: int, make_row=None):
        self.collator, self.seed, self.process, self.make_row = collator, seed, process, make_row

    def __call__(self, items: list) -> dict:
        (epoch, number, _), _ = items[0]
        rows = [r if self.make_row is None else self.make_row(epoch, i, r) for (_, _, i), r in items]
        if getattr(self.collator, "generator", None) is not None:
            # numpy's SeedSequence hashes the key, so nearby keys give unrelated streams; 63 bits, as manual_seed takes
            key = np.random.SeedSequence([int(self.seed), int(epoch), int(number), int(self.process)])
            self.collator.generator.manual_seed(int(key.generate_state(1, np.uint64)[0] >> 1))
        return self.collator(rows)

# STOP_SIGNALS (common.py): what a scheduler sends before it ends a job, and Ctrl-C (docs/plumbing.md: STOP_SIGNALS).
# The main process answers them (training.StopSignals, common.run_script); the loader's workers leave them to it.

def leave_stop_signals_to_the_main_process(worker_id: int):
    """A loader worker's start (worker_init_fn): ignore STOP_SIGNALS (docs/plumbing.md: STOP_SIGNALS). The workers
    end as always, when the main process is done with them (or dies)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)

def training_loader(accelerator, args, rows, sampler, collator, make_row=None):
    """The run's DataLoader (not yet prepared): the sampler's batches collated by --dataloader_num_workers processes
    (SeededCollate), pinned by the loader's own thread on CUDA (loader_options). generator: the loader's base seed,
    not the global RNG that drives dropout."""
    # torchrun and accelerate launch say how many processes share this machine
    workers, pin = loader_options(accelerator.device.type, args.dataloader_num_workers,
                                  int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    collate = SeededCollate(collator, args.seed, accelerator.process_index, make_row)
    return torch.utils.data.DataLoader(RowsDataset(rows), batch_sampler=KeyedBatches(sampler), collate_fn=collate,
                                       num_workers=workers, pin_memory=pin,
                                       worker_init_fn=leave_stop_signals_to_the_main_process,
                                       generator=torch.Generator().manual_seed(args.seed))

def loader_options(device_type: str, workers=None, local_processes: int = 1, cpus=None) -> tuple[int, bool]:
    """(collating worker processes, pin memory) for a `device_type` loader. CUDA: --dataloader_num_workers, else the
    cores shared among processes (one left each, at most 8), pinned. CPU: 0 workers, nothing to pin."""
    on_gpu = device_type != "cpu"
    if workers is None:
        cpus = cpus if cpus is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                              else os.cpu_count() or 1)
        workers = max(1, min(8, cpus // max(local_processes, 1) - 1)) if on_gpu else 0
    return workers, device_type == "cuda"

def padding_efficiency(batch, skip=()) -> tuple[int, int]:
    """(real tokens, processed tokens) over every *attention_mask tensor of a collated batch (keys starting with
    one of `skip` left out: the retention inputs are not processed when retention is off)."""
    real = proc = 0
    for k, v in batch.items():
        if k.endswith("attention_mask") and torch.is_tensor(v) and not k.startswith(tuple(skip)):
            real += int(v.sum())
            proc += v.numel()
    return real, proc

def batch_to_device(batch, device):
    """The one move of a collated batch to the device (train_loop). The prepared loader hands CPU tensors
    (prepare_run prepares it without device placement), so what runs on the host (padding_efficiency, the memory
    estimate) never waits on the device; on CUDA the loader has pinned them (loader_options), and the copy does not
    wait either. A tensor already on the device is left as it is."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
