"""``specdecode train heads --kind hydra|clover|eagle|deer``: draft heads by self-distillation.

1. data: the conversations the target writes itself: a ``specdecode train data`` shard
   (``--shard``, :mod:`specdecode.training.target_data`), or else
   :mod:`specdecode.training.self_data`'s cache (shared with ``train draft``: made once, read
   by every trainer). A tenth (at most 200) is held out.
2. features: the target reads a conversation when a step first needs it, one prefill of the
   runner the heads will draft for (``--runner``, the default one: native int4 for SmolLM2),
   so training sees the features drafting will read: its final hidden states (what its LM
   head reads, the teacher's distribution) and, for EAGLE-3 and deer, chosen layers'. The
   ``hf`` runner (a GPU's) reads the step's conversations with the next ones, 32 in one padded
   forward. A shard written with ``--features`` holds them already, computed by the forwards
   that wrote it (:mod:`specdecode.training.feature_store`; read where they are that
   runner's). They are kept in memory for later epochs up to ``--feature-cache`` (2 GB on a
   CPU; past that, read again: a prefill is a quarter of a step), so the data may be any size.
3. the FR-Spec shortlist (Zhao et al., 2025): the ``--shortlist`` most frequent tokens of the
   training conversations; its coverage of the held-out answers is measured and stored.
4. training, teacher forcing over whole conversations: at every position t and depth k the
   network's feature scores token t + k + 2 over the shortlist, and the loss is KL(p_target ||
   q_head) against the target's own distribution there (Hydra++'s teacher loss; soft labels
   teach more per position than the sampled token). EAGLE is EAGLE-3's: it reads layers 2,
   L // 2 and L - 3 and is unrolled on its own predictions for 4 steps (training-time test;
   the paper's 7: every step costs as much as the first on a CPU, and the default trees
   rarely reach depth 4, docs/draft-heads.md), the loss at step k weighted 0.8^k, without
   EAGLE-1's feature regression (EAGLE-3 drops it). deer (the block drafter) reads a low and
   a middle layer's hidden states besides the final ones, and learns from ``--anchors`` random
   answer positions a step, each the root of an all-masked block whose row k is scored against
   the target's distribution at the k-th position after it (DEER's first stage), the loss of
   row k weighted 0.8^k (its second stage's emphasis on the block's first positions).
   AdamW, lr 1e-3 after 20 warm-up steps, decaying linearly to a tenth over the budget; one
   conversation a step, or ``--pack`` N of them one after another (each row seeing its own
   conversation only; deer: ``--anchors`` of each), so that a GPU step is not bound by kernel
   launches.
5. evaluation on the held-out conversations: per depth, how often the head's top token is the
   target's greedy token (teacher forcing: the acceptance of a chain's node given its parent
   was accepted); stored with the artifact.

Bounded (``--max-minutes``, all phases together) and resumable (``--resume`` continues from the
checkpoint in ``--workdir``). The artifact (kind ``<kind>_heads``, tied to the target's
fingerprint) stores matrices in int8 with float16 row scales.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.artifacts import float_rows, int8_rows, user_dir
from specdecode.errors import require
from specdecode.heads.artifact import artifact_kind, save_heads
from specdecode.heads.drafter import target_features
from specdecode.heads.networks import NETWORKS, feature_layers, make_network, parameter_count
from specdecode.heads.packing import packed, packed_rows
from specdecode.models.base import ForwardOutput, Needs
from specdecode.training.feature_store import FeatureStore, reader_name, store_dir
from specdecode.training.runs import (Checkpoint, TimeBar, descend, target_key, training_device,
                                      use_device, work_dir)
from specdecode.training.self_data import (frequency_shortlist, shortlist_coverage,
                                           target_conversations)

#: training depth per kind: Hydra's heads, the unrolled steps of Clover and EAGLE-3's
#: training-time test (the paper unrolls 7; here 4 for the CPU's sake, docs/draft-heads.md)
DEPTHS = {"hydra": 4, "clover": 4, "eagle": 4, "deer": 8}
#: the weight of the loss at draft depth k, 0.8^k: EAGLE-3's for its unrolled steps; deer's
#: block rows too (DEER's second stage and DFlash weigh a block's first positions most)
STEP_DECAY = 0.8
#: most bytes of features kept between epochs (a prefill is a quarter of a training step)
CACHE_BYTES = 2 << 30
#: most held-out conversations (evaluating one costs a prefill and a forward of the network)
MAX_HELD_OUT = 200
#: the kinds whose training takes several conversations packed into one step (``--pack``)
PACKABLE = ("hydra", "eagle", "deer")
#: conversations the hf runner reads in one padded forward when a step meets an unread one: on
#: a GPU one conversation's prefill is bound by kernel launches, so 32 cost about what one does
READ_AHEAD = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=sorted(NETWORKS),
                        help="the network: hydra, clover, eagle or deer (the block drafter)")
    parser.add_argument("--model", default="smollm2",
                        help="target: 'smollm2' (default), a .gguf file or a checkpoint folder")
    parser.add_argument("--max-minutes", type=float, default=12.0,
                        help="wall-clock budget of this run, all phases together")
    parser.add_argument("--shard", default=None, metavar="FILE",
                        help="train on a `specdecode train data` shard (else on the conversations "
                             "cached for `train draft`, written if missing)")
    parser.add_argument("--conversations", type=int, default=None,
                        help="target-written conversations to train on (default: all of --shard, "
                             "else 320, shared with `train draft`)")
    parser.add_argument("--batch", type=int, default=64,
                        help="conversations written at once (the cache is per batch size)")
    parser.add_argument("--data-share", type=float, default=0.5,
                        help="largest share of the budget spent writing conversations not cached yet")
    parser.add_argument("--shortlist", type=int, default=8192,
                        help="tokens the heads score (FR-Spec; 0 = the whole vocabulary)")
    parser.add_argument("--depth", type=int, default=None,
                        help="depths trained (default: hydra 4 heads, clover 4, eagle 4 steps, "
                             "deer its block of 8)")
    parser.add_argument("--layers", type=int, default=1,
                        help="deer: decoder layers of the drafter (1 or 2 in DFlash's range)")
    parser.add_argument("--anchors", type=int, default=24,
                        help="deer: blocks trained per conversation a step (random answer "
                             "positions)")
    parser.add_argument("--pack", type=int, default=1,
                        help="hydra, eagle, deer: conversations packed into one training "
                             "step (each sees only itself): what fills a GPU, where one "
                             "conversation a step is bound by kernel launches")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    parser.add_argument("--feature-cache", type=float, default=None, metavar="GB",
                        help="most gigabytes of features kept between epochs (default: 2 on "
                             "the CPU; on a GPU a quarter of its free memory, up to 16: pass a "
                             "share when several trainers start on one GPU together)")
    parser.add_argument("--out", default=None,
                        help="artifact path (default: the user cache, where the method finds it)")
    parser.add_argument("--workdir", default=None,
                        help="features and checkpoint (default: under the user cache)")
    parser.add_argument("--runner", default="auto", choices=["auto", "native", "hf"],
                        help="the runner whose final hidden states the heads learn from: the one "
                             "they will draft for (auto: the default runner)")
    parser.add_argument("--init", default=None, metavar="ARTIFACT",
                        help="start from a heads artifact of this kind and target: every weight "
                             "whose name and shape match (e.g. an EAGLE-1 artifact's layer for "
                             "an EAGLE-3 network; its new fusion starts fresh), or whose shape "
                             "broadcasts (an older deer's one mask for every row)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def conversation_features(runner, net, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """One conversation read by the runner: what ``net`` reads of every position [T, F] and
    the final hidden states [T, H] (normed: what the LM head reads, the teacher's), float32."""
    with torch.inference_mode():
        out = runner.prefill(ids, Needs(final_hidden=True, layers=net.feature_layers))
        inputs, final = target_features(net, out), out.final_hidden
    # clones made outside inference mode: autograd may save them
    return inputs.float().clone(), final.float().clone()


def stored_features(store: FeatureStore | None, net, ids) -> tuple | None:
    """:func:`conversation_features` kept by the forwards that wrote ``ids`` (None where the
    store holds none of this runner's with the layers ``net`` reads)."""
    out = None if store is None else store.load(ids, net.feature_layers)
    if out is None:
        return None
    return target_features(net, out).float(), out.final_hidden.float()


def batch_features(model, net, sequences: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`conversation_features` of several conversations in one forward of a transformers
    model, padded on the right (a causal row reads no padding, so each conversation's rows are
    its own prefill's, up to the batched kernels' rounding)."""
    lengths = [len(ids) for ids in sequences]
    device = next(model.parameters()).device
    tokens = torch.zeros(len(sequences), max(lengths), dtype=torch.long, device=device)
    mask = torch.zeros_like(tokens)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)] = torch.tensor(ids, device=device)
        mask[row, :len(ids)] = 1
    with torch.inference_mode():
        states = model(input_ids=tokens, attention_mask=mask, output_hidden_states=True,
                       use_cache=False, logits_to_keep=1).hidden_states
        read = []
        for row, n in enumerate(lengths):
            out = ForwardOutput(None, states[-1][row, :n].float(),
                                {layer: states[layer][row, :n] for layer in net.feature_layers})
            read.append((target_features(net, out), out.final_hidden))
    return [(inputs.float().clone(), final.clone()) for inputs, final in read]


def depth_losses(outputs: dict, features: torch.Tensor, head: torch.Tensor,
                 anchors: torch.Tensor | None = None, starts=None):
    """{depth: loss} for one conversation, or several packed (``starts``, where each begins:
    the rows scoring another conversation's token left out); outputs[k] row t (or
    ``anchors[t]``, where the network read only those positions) scores token t + k + 2, whose
    target distribution is the LM head's on the final features [T, H] at position t + k + 1."""
    with torch.no_grad():  # every position's once: depth k reads it shifted by k
        teachers = (features @ head.T).log_softmax(-1)
    losses = {}
    for k, out in outputs.items():
        rows = torch.arange(len(out), device=out.device) if anchors is None else anchors[:len(out)]
        keep = packed_rows(len(features), starts, k, rows)
        if keep is not None:
            rows, out = rows[keep.to(out.device)], out[keep.to(out.device)]
        teacher = teachers[rows + k + 1]
        student = (out @ head.T).log_softmax(-1)
        losses[k] = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    return losses


def step_loss(kind: str, losses: dict) -> torch.Tensor:
    """The depths' losses as one: their mean, or (eagle, deer) weights decaying 0.8^k along
    the draft, normalised: EAGLE-3's for its unrolled steps, and DEER's second stage and DFlash's
    emphasis on a block's first positions, where verification decides (a mean let the deep,
    rarely predictable rows set a one-layer drafter's weights)."""
    weights = {k: STEP_DECAY ** k if kind in ("eagle", "deer") else 1.0 for k in losses}
    return sum(weights[k] * loss for k, loss in losses.items()) / sum(weights.values())


@torch.no_grad()
def evaluate(net, data: "_Data", depth: int) -> list[float]:
    """Per depth: the share of held-out answer positions where the head's top shortlist token
    is the target's greedy token (teacher forcing)."""
    hits, total = [0] * depth, [0] * depth
    for first in range(0, len(data.evaluation), READ_AHEAD):
        data.read_ahead(net, [ids for ids, _ in data.evaluation[first:first + READ_AHEAD]])
    for ids, prompt_len in data.evaluation:
        inputs, final = data.features(net, ids)
        net.reset()
        outputs = net.train_outputs(inputs, torch.tensor(ids), depth)
        # the target's greedy token after each answer position, once for every depth (the
        # whole LM head over a conversation's answer, per depth, was most of this phase)
        first = max(prompt_len - 1, 0)
        greedy = torch.full((len(final),), -1, dtype=torch.long, device=final.device)
        greedy[first:] = (final[first:] @ data.full_head.T).argmax(-1)
        for k, out in outputs.items():
            rows = torch.arange(len(out))
            keep = rows + k + 1 >= first  # the target's answer positions
            want = greedy[k + 1: k + 1 + len(out)][keep]
            got = (out[keep] @ data.head.T).argmax(-1)
            if data.head_ids is not None:
                got = data.head_ids[got]
            hits[k] += int((got == want).sum())
            total[k] += int(keep.sum())
    return [round(h / max(t, 1), 4) for h, t in zip(hits, total)]


def _cache_bytes(device: torch.device, gigabytes: float | None = None) -> int:
    """Bytes of features kept between epochs: ``gigabytes`` (``--feature-cache``), else
    CACHE_BYTES of the CPU's memory, or a quarter of a GPU's free memory (up to 16 GB: every
    conversation of a large shard)."""
    if gigabytes is not None:
        return int(gigabytes * (1 << 30))
    if device.type != "cuda":
        return CACHE_BYTES
    return min(16 << 30, torch.cuda.mem_get_info(device)[0] // 4)


@dataclass
class _Data:
    """Phases 1-3: the conversations split into training and held-out ones, the runner that
    reads their features, and the LM head the heads score with (its shortlist rows)."""

    train: list
    evaluation: list
    runner: object
    #: which conversations ("shard NAME" or "self-written") and which runner reads them
    source: str
    reader: str
    #: the input embeddings, the whole LM head (float32), the shortlist (None: every token)
    embed: torch.Tensor
    full_head: torch.Tensor
    head_ids: torch.Tensor | None
    coverage: float
    #: bytes of features kept between epochs (:func:`_cache_bytes`, fixed at the start)
    cache_limit: int = CACHE_BYTES
    #: whether several conversations are read in one padded forward (the hf runner's model)
    padded_reads: bool = False
    #: the features the forwards that wrote the shard kept (``train data --features``)
    store: FeatureStore | None = None

    #: conversations' features kept for the next epoch, up to ``cache_limit``, and their bytes
    cache: dict = field(default_factory=dict)
    cache_held: int = 0

    @property
    def head(self) -> torch.Tensor:
        return self.full_head if self.head_ids is None else self.full_head[self.head_ids]

    def features(self, net, ids) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features_of(net, [ids])[0]

    def features_of(self, net, sequences: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The features of ``sequences``: the cached ones, the others read (the hf runner's in
        one padded forward, :func:`batch_features`) and kept while the cache has room."""
        keys = [tuple(ids) for ids in sequences]
        unread = list(dict.fromkeys(key for key in keys if key not in self.cache))
        fresh = {key: stored_features(self.store, net, key) for key in unread}
        unread = [key for key in unread if fresh[key] is None]
        if len(unread) > 1 and self.padded_reads:
            fresh.update(zip(unread, batch_features(self.runner.model, net, unread)))
        else:
            fresh.update((key, conversation_features(self.runner, net, key)) for key in unread)
        passing = {}
        for key, (inputs, final) in fresh.items():
            if self.cache_held + inputs.nbytes + final.nbytes > self.cache_limit:
                passing[key] = (inputs, final)
                continue
            self.cache[key] = (inputs, final)
            self.cache_held += inputs.nbytes + final.nbytes
        return [self.cache[key] if key in self.cache else passing[key] for key in keys]

    def read_ahead(self, net, upcoming: list) -> None:
        """Reads the unread of ``upcoming`` together while the cache has room for them (the
        hf runner: a step then finds its conversation read)."""
        if self.padded_reads and self.cache_held < self.cache_limit:
            self.features_of(net, upcoming)


@dataclass
class _Target:
    """What training reads of the target besides its features: the fingerprint its artifacts
    are tied to, its layer count, its tables (float32) and final norm weight (None where the
    network needs none of it)."""

    fingerprint: str
    num_layers: int
    embed: torch.Tensor
    full_head: torch.Tensor
    final_norm: torch.Tensor | None


def _target(loaded, args: argparse.Namespace):
    """The runner that reads the conversations' features and :class:`_Target`. On the CPU the
    runner the heads will draft for gives both: a GGUF target's ``transformers`` model (every
    weight in float32: 7 GB for a 1.5B) is then never built. On a GPU, the hf runner over the
    model moved there."""
    from specdecode.models.loading import make_runner

    device = training_device()
    if device == "cpu" and args.runner != "hf":
        runner = make_runner(loaded, args.runner)
        if runner.name != "hf":
            return runner, _Target(runner.fingerprint(), runner.num_layers,
                                   runner.tables.input_embeddings(),
                                   runner.tables.output_embeddings().float(),
                                   getattr(runner, "final_norm", None))
    model = loaded.model.requires_grad_(False)
    if device != "cpu":  # the features come from the hf runner on the GPU
        require(args.runner != "native", f"--runner native reads features on the CPU; on "
                                         f"{device} train with --runner hf (or auto)")
        model.to(device)
        use_device(device)
    runner = make_runner(loaded, "hf")
    norm = getattr(getattr(model, "model", None), "norm", None)
    return runner, _Target(runner.fingerprint(), model.config.num_hidden_layers,
                           model.get_input_embeddings().weight.detach(),
                           model.get_output_embeddings().weight.detach().float(),
                           None if norm is None else norm.weight.detach())


def run(args: argparse.Namespace) -> int:
    from specdecode.models.loading import load_model

    depth = _checked_depth(args)
    budget = 60 * args.max_minutes
    bar = TimeBar(budget, f"train {args.kind} heads", shown=not args.no_progress)
    deadline = bar.began + budget
    loaded = load_model(args.model)
    runner, target = _target(loaded, args)
    fingerprint = target.fingerprint
    key = target_key(fingerprint)
    workdir = work_dir(args.workdir, user_dir() / f"heads-work-{key}")
    checkpoint = Checkpoint(workdir / f"{args.kind}-checkpoint.pt", args.resume)
    torch.manual_seed(args.seed)
    data = _data(loaded, runner, target, args, args.data_share * budget, bar.show)

    # 4. training
    net = make_network(args.kind, data.embed.shape[1], data.embed,
                       **network_settings(args, target.num_layers))
    _norms_like_the_target(net, target.final_norm)
    optim = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    state = {"fingerprint": fingerprint, "kind": args.kind, "settings": net.settings(),
             "step": 0, "log": []}
    saved = checkpoint.load(
        lambda s: all(s[k] == state[k] for k in ("fingerprint", "kind", "settings")),
        "another target or network; start afresh without --resume (or pass another --workdir)")
    if saved is not None:
        net.load_state_dict(saved["net"])
        optim.load_state_dict(saved["optim"])
        state.update(step=saved["step"], log=saved["log"])
    elif args.init:
        _warm_start(net, args.init, fingerprint)
    # the end keeps time to evaluate (a prefill and a forward per held-out conversation)
    _train(net, optim, data, depth, state, checkpoint, args,
           deadline - max(30.0, 0.08 * budget), bar.show)
    path = _evaluate_and_save(net, data, depth, state, args, key, fingerprint, bar)
    print(f"saved {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def _norms_like_the_target(net, final_norm: torch.Tensor | None) -> None:
    """The state norms of a network that reads chosen layers (EAGLE-3's, deer's) start as the
    target's final norm: the shortlist of its LM head then scores the untrained network's
    states at the scale of the target's own (and an ``--init`` EAGLE-1 layer reads states at
    the scale it was trained on)."""
    if not net.feature_layers or final_norm is None:
        return
    with torch.no_grad():
        for name in ("hidden_norm", "out_norm"):
            if hasattr(net, name):
                getattr(net, name).weight.copy_(final_norm.float())


def _warm_start(net, path: str, fingerprint: str) -> None:
    """``net``'s weights that ``path`` (an artifact of its kind for this target) holds under the
    same name and shape, or one that broadcasts to it (deer's one mask vector, for a network
    with a mask a row); the rest keep their initial values."""
    from specdecode.artifacts import load_artifact

    stored = load_artifact(path, artifact_kind(net.kind), fingerprint).tensors
    own = net.state_dict()
    taken = {name: stored[f"net.{name}"].to(value.dtype).expand(value.shape).clone()
             for name, value in own.items()
             if f"net.{name}" in stored and _broadcasts(stored[f"net.{name}"].shape, value.shape)}
    require(bool(taken), f"{path} holds none of this network's weights; leave out --init")
    net.load_state_dict({**own, **taken})
    print(f"--init: {len(taken)} of {len(own)} tensors from {path}")


def _broadcasts(stored: torch.Size, own: torch.Size) -> bool:
    """Whether a stored tensor of shape ``stored`` fills one of shape ``own``: the same shape,
    or its trailing dimensions with the leading ones added."""
    return stored == own or (len(stored) < len(own) and stored == own[len(own) - len(stored):])


def _evaluate_and_save(net, data: _Data, depth: int, state: dict, args: argparse.Namespace,
                       key: str, fingerprint: str, bar: TimeBar) -> Path:
    """Phase 5: what is stored is evaluated (the int8 round trip of the weights first)."""
    with torch.no_grad():
        stored = int8_rows({k: v.half() for k, v in net.state_dict().items()})
        net.load_state_dict(float_rows(stored))
    bar.show("evaluation")
    accuracy = evaluate(net.eval(), data, depth)
    use_device("cpu")
    net.cpu()
    head_ids = None if data.head_ids is None else data.head_ids.cpu()
    info = {"kind": args.kind, "depth_trained": depth, "features": data.reader,
            "init": Path(args.init).name if args.init else None,
            "data": data.source, "shortlist": args.shortlist,
            "shortlist_coverage": round(data.coverage, 4),
            "conversations": len(data.train) + len(data.evaluation),
            "train_tokens": sum(len(ids) for ids, _ in data.train),
            "held_out": len(data.evaluation), "steps": state["step"], "lr": args.lr,
            "loss_log": state["log"], "top1_agreement_per_depth": accuracy,
            "parameters": parameter_count(net),
            "minutes": round((time.monotonic() - bar.began) / 60, 1)}
    out = (Path(args.out) if args.out
           else user_dir() / f"{artifact_kind(args.kind)}-{key}.safetensors")
    path = save_heads(out, net, head_ids, fingerprint, info)
    bar.close()
    print(f"{args.kind} heads: {parameter_count(net) / 1e6:.2f}M parameters, {state['step']} "
          f"steps on {len(data.train)} conversations ({data.source}) in {info['minutes']} min")
    if data.store is not None:
        print(f"features: {data.store.found} reads from {data.store.root}, {data.store.missed} "
              "conversations read by the runner")
    print(f"shortlist: {args.shortlist} tokens cover {data.coverage:.1%} of the held-out answer "
          "tokens")
    print("top-1 agreement with the target's greedy token on held-out answers, per depth: "
          + ", ".join(f"{a:.1%}" for a in accuracy))
    return path


def network_settings(args: argparse.Namespace, num_layers: int) -> dict:
    """The network's settings besides its width: the target layers it reads
    (:func:`~specdecode.heads.networks.feature_layers`), and for deer its layers and block."""
    layers = feature_layers(args.kind, num_layers)
    settings = {"feature_layers": layers} if layers else {}
    if args.kind == "deer":
        settings.update(layers=args.layers, block=args.depth or DEPTHS["deer"], anchor_input=True,
                        row_inputs=True)
    return settings


def _checked_depth(args: argparse.Namespace) -> int:
    """The depth to train, after checking the arguments (before anything loads)."""
    require(args.max_minutes > 0, f"--max-minutes must be positive, got {args.max_minutes}")
    require(args.conversations is None or args.conversations >= 10,
            f"--conversations must be >= 10, got {args.conversations}")
    require(args.shard is None or Path(args.shard).is_file(),
            f"--shard {args.shard} is not a file; write one with `specdecode train data --out "
            f"{args.shard}`")
    require(args.batch >= 1, f"--batch must be >= 1, got {args.batch}")
    require(args.shortlist >= 0, "--shortlist must be >= 0 (0 = whole vocabulary)")
    depth = args.depth or DEPTHS[args.kind]
    require(depth >= 1, f"--depth must be >= 1, got {depth}")
    require(args.layers >= 1, f"--layers must be >= 1, got {args.layers}")
    require(args.pack >= 1, f"--pack must be >= 1, got {args.pack}")
    require(args.feature_cache is None or args.feature_cache >= 0,
            f"--feature-cache must be >= 0 gigabytes, got {args.feature_cache}")
    require(args.pack == 1 or args.kind in PACKABLE,
            f"--pack packs conversations for {', '.join(PACKABLE)} only; leave it out for "
            f"{args.kind}")
    return depth


def _conversations(loaded, fingerprint: str, args: argparse.Namespace, data_seconds: float,
                   show) -> tuple[list, str]:
    """The conversations (ids, prompt length) and where they come from: the shard's, in index
    order, or self_data's cache (the draft trainer's defaults: one cache serves both)."""
    if args.shard:
        from specdecode.training.target_data import read_shard

        shard = read_shard(Path(args.shard))
        require(len(shard) >= 10, f"{args.shard} holds {len(shard)} conversations; write more "
                                  "with `specdecode train data`")
        sequences = [shard[i] for i in sorted(shard)][:args.conversations]
        return sequences, f"shard {Path(args.shard).name}"
    sequences = target_conversations(loaded.model, loaded.tokenizer, fingerprint,
                                     args.conversations or 320, prompt_tokens=64,
                                     answer_tokens=160, batch=args.batch, seed=0,
                                     seconds=data_seconds, show=show)
    return sequences, "self-written"


def _data(loaded, runner, target: _Target, args: argparse.Namespace, data_seconds: float,
          show) -> _Data:
    """Phases 1-3: conversations, a tenth held out, the shortlist; ``runner`` (the one the
    heads will draft for) reads their features."""
    sequences, source = _conversations(loaded, target.fingerprint, args, data_seconds, show)
    reader = reader_name(runner)
    held = min(MAX_HELD_OUT, max(2, len(sequences) // 10))
    evaluation, train = sequences[:held], sequences[held:]
    full_head = target.full_head
    vocab = full_head.shape[0]
    head_ids = (frequency_shortlist(train, args.shortlist, vocab)
                if 0 < args.shortlist < vocab else None)
    coverage = 1.0 if head_ids is None else shortlist_coverage(head_ids, evaluation)
    store = (FeatureStore(Path(args.shard), reader, runner.fingerprint())
             if args.shard and store_dir(Path(args.shard)).is_dir() else None)
    return _Data(train, evaluation, runner, source, reader, target.embed, full_head, head_ids,
                 coverage, _cache_bytes(full_head.device, args.feature_cache),
                 padded_reads=runner.name == "hf", store=store)


def _anchors(prompt_len: int, n: int, count: int) -> torch.Tensor:
    """``count`` random anchors (ascending) among the answer's positions of a conversation of
    ``n`` tokens: a deer step scores a block of rows per anchor, so it reads a sample of them
    (every anchor of a conversation would cost a hundred times a hydra step)."""
    first = max(0, prompt_len - 2)
    choices = torch.arange(first, n - 1)
    pick = torch.randperm(len(choices))[:count]
    return choices[pick].sort().values


def _train(net, optim, data: _Data, depth: int, state: dict, checkpoint: Checkpoint,
           args: argparse.Namespace, deadline: float, show) -> None:
    """Phase 4 until ``deadline``: one conversation a step (``--pack``: that many, packed), the
    learning rate warmed up over 20 steps then decaying linearly to a tenth; a checkpoint every
    two minutes and at the end.
    ``state`` holds the step and the loss log (every 50 steps)."""
    def save() -> None:
        checkpoint.save({**state, "net": net.state_dict(), "optim": optim.state_dict()})

    train, head = data.train, data.head
    start = time.monotonic()
    last_save, recent = start, []
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed),
                           device="cpu")
    while time.monotonic() < deadline:
        step = state["step"]
        chosen = [train[int(order[(step * args.pack + i) % len(train)])] for i in range(args.pack)]
        if args.pack == 1 and tuple(chosen[0][0]) not in data.cache:
            data.read_ahead(net, [train[int(order[(step + i) % len(train)])][0]
                                  for i in range(READ_AHEAD)])
        elapsed = (time.monotonic() - start) / max(deadline - start, 1.0)
        for group in optim.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20) * (1.0 - 0.9 * min(elapsed, 1.0))
        net.reset()
        anchors = starts = None
        if len(chosen) > 1:  # --pack: one after another, each seeing only itself
            read = data.features_of(net, [ids for ids, _ in chosen])
            ids, starts = packed([ids for ids, _ in chosen])
            inputs, final = torch.cat([r[0] for r in read]), torch.cat([r[1] for r in read])
            if args.kind == "deer":
                anchors = torch.cat([_anchors(prompt_len, len(one), args.anchors) + start
                                     for (one, prompt_len), start in zip(chosen, starts)])
                outputs = net.train_outputs(inputs, torch.tensor(ids), depth, anchors, starts)
            else:
                outputs = net.train_outputs(inputs, torch.tensor(ids), depth, starts)
        else:
            ids, prompt_len = chosen[0]
            inputs, final = data.features(net, ids)
            tokens = torch.tensor(ids)
            if args.kind == "deer":
                anchors = _anchors(prompt_len, len(ids), args.anchors)
                outputs = net.train_outputs(inputs, tokens, depth, anchors)
            else:
                outputs = net.train_outputs(inputs, tokens, depth)
        losses = depth_losses(outputs, final, head, anchors, starts)
        value = descend(step_loss(args.kind, losses), optim, net.parameters(), step)
        state["step"] = step = step + 1
        recent = (recent + [value])[-20:]
        if step % 50 == 0:
            state["log"].append({"step": step, "loss": round(sum(recent) / len(recent), 4)})
        show(f"step {step} loss {sum(recent) / len(recent):.3f}")
        if time.monotonic() - last_save > 120:
            save()
            last_save = time.monotonic()
    save()
