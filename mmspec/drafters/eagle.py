"""EAGLE (Li et al., 2024): draft at the feature level with one decoder layer over the target's
own features.

At position t the head reads the target's last hidden state f_t ([H], the input of the LM head)
and the embedding of the token that follows it, e(x_{t+1}), and predicts the next feature:

    f^_{t+1} = Norm(Layer(W_fc [e(x_{t+1}); f_t]))        logits_{t+2} = LMHead_target(f^_{t+1})

Drafting continues on the head's own predictions (f^ replaces f). The token embedding and the LM
head are the target's (shared, never copied); only W_fc, one decoder layer of the target's family
and a norm are trained (``mmspec train drafter --method eagle``). Training loss (the paper's):
SmoothL1(f^, f) + 0.1 * CE(LMHead(f^), x).

The head keeps its own KV cache over the committed (feature, token) pairs; features of the
committed tokens arrive with every verification (``requires_target_hidden``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from ..adapters.hf import text_decoder
from ..core.cache import SequenceState, crop_cache
from ..core.drafter import Draft, Drafter, register_drafter
from ..core.cost import ChainAcceptance, CostModel, DepthCalibration, cached_verification_cost
from ..core.target import TargetOutput
from ..core.sampling import logits_to_probs
from ..core.tree import TokenTree, dynamic_tree, sampled_dynamic_tree
from .shipped import shipped_drafter_dir
from .vocab import DraftLMHead, load_draft_vocabulary

HEAD_CONFIG = "eagle_config.json"
HEAD_WEIGHTS = "eagle_head.safetensors"


class OneLayerHead(nn.Module):
    """One decoder layer of the target's family (+ its final norm) reading embeddings: the trained
    part of feature-level drafters. Subclasses define what goes in.

    Args:
        text_config: the target decoder's config (its family, width, heads, rope); the head uses
            one layer of it and no vocabulary of its own.
    """

    method = "eagle"
    config_file = HEAD_CONFIG
    weights_file = HEAD_WEIGHTS

    def __init__(self, text_config) -> None:
        super().__init__()
        from transformers import AutoModel

        config = copy.deepcopy(text_config)
        config.num_hidden_layers = 1
        config.vocab_size = 1  # inputs arrive as embeddings; the target's embedding table is shared
        config.pad_token_id = None
        if hasattr(config, "layer_types") and config.layer_types:
            config.layer_types = config.layer_types[:1]
        self.config = config
        self.decoder = AutoModel.from_config(config)

    def run_decoder(self, inputs: torch.Tensor, cache, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.decoder(inputs_embeds=inputs, past_key_values=cache, position_ids=position_ids,
                            attention_mask=attention_mask, use_cache=cache is not None).last_hidden_state

    def save(self, directory: str | Path, **card) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(directory / self.weights_file))
        (directory / self.config_file).write_text(json.dumps({"text_config": self.config.to_dict(), **card}, indent=1))

    @classmethod
    def load(cls, directory: str | Path, target_model: nn.Module):
        """Load a head saved by :meth:`save` for ``target_model`` (checks the widths match)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / cls.config_file).is_file():
            raise FileNotFoundError(
                f"no {cls.method} head in {directory} ({cls.config_file} missing); train one with `mmspec train drafter --method {cls.method}`"
            )
        target_config = text_decoder(target_model).config
        saved = json.loads((directory / cls.config_file).read_text())["text_config"]
        if saved["hidden_size"] != target_config.hidden_size:
            raise ValueError(f"the {cls.method} head in {directory} has width {saved['hidden_size']}, the target {target_config.hidden_size}")
        head = cls(target_config)
        head.load_state_dict(load_file(str(directory / cls.weights_file)))
        param = next(target_model.parameters())
        return head.to(device=param.device, dtype=param.dtype).eval()


class EagleHead(OneLayerHead):
    """fc [2H -> H] over [token embedding; target feature], then the decoder layer and norm."""

    def __init__(self, text_config) -> None:
        super().__init__(text_config)
        hidden = self.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, cache, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """features: [B, n, H]; token_embeds: [B or 1, n, H]; position_ids: [1, n]; attention_mask:
        None (causal) or a 4-D additive mask [1, 1, n, cached + n] -> predicted next features [B, n, H]."""
        token_embeds = token_embeds.expand(features.shape[0], -1, -1)
        return self.run_decoder(self.fc(torch.cat([token_embeds, features], dim=-1)), cache, position_ids, attention_mask)


@register_drafter("eagle")
class EagleDrafter(Drafter):
    """Chain drafting with an EAGLE head (K tokens per step).

    Args:
        target_model: the transformers target (its input embeddings and LM head are used).
        head: a trained :class:`EagleHead`.
        num_draft_tokens: K.
        draft_vocabulary: LongTensor [N] of token ids to draft from (:mod:`mmspec.drafters.vocab`;
            shipped next to the head), or None for the whole vocabulary.
    """

    requires_target_hidden = True

    def __init__(self, target_model: nn.Module, head: EagleHead, num_draft_tokens: int = 5,
                 draft_vocabulary: torch.Tensor | None = None) -> None:
        super().__init__(num_draft_tokens)
        self.head = head
        self.embed, self.lm_head = self._target_parts(target_model, draft_vocabulary)
        self.cache = None
        self.fed = 0  # pairs (f_t, x_{t+1}) for position_base <= t < fed are in the head's cache
        self.position_base = 0  # the sequence position of the head's first pair (its cache entry 0)
        self.features: torch.Tensor | None = None  # target features [R, n, H] of positions fed, fed + 1, ...

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "EagleDrafter":
        path = arg or shipped_drafter_dir(target.model, "eagle", HEAD_CONFIG)
        return cls(target.model, EagleHead.load(path, target.model), num_draft_tokens or 5, load_draft_vocabulary(path))

    def start(self, context, state: SequenceState) -> None:
        from transformers import DynamicCache

        super().start(context, state)
        self.cache = DynamicCache()
        self.fed = 0
        self.features = None

    @staticmethod
    def _target_parts(target_model: nn.Module, draft_vocabulary: torch.Tensor | None):
        """(the target's token embedding, its LM head restricted to the draft vocabulary)."""
        return target_model.get_input_embeddings(), DraftLMHead(target_model.get_output_embeddings(), draft_vocabulary)

    @property
    def head_cache_length(self) -> int:
        return self.fed - self.position_base

    def _draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Predicted features [R, n, H] -> draft logits [n, N] (R = 1 here; the image drafter
        combines its guidance rows)."""
        return self.lm_head(predicted[0])

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        """Keep the target features of the committed inputs (the prefill's whole prompt, or the
        pending token + the accepted drafts)."""
        new = target_output.hidden_states[:, : num_accepted + 1] if num_drafted or self.features is not None else target_output.hidden_states
        self.features = new if self.features is None else torch.cat([self.features, new], dim=1)

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed pairs (features [R, n, H], next tokens [1, n]) at positions start.. -> predicted features [R, n, H]."""
        start -= self.position_base
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        return self.head(features, self.embed(tokens), self.cache, positions)

    def _catch_up(self, state: SequenceState) -> torch.Tensor:
        """Feed the committed pairs not yet in the head's cache (features of positions fed .. L-2,
        tokens fed+1 .. L-1) -> the predicted feature after the last committed token [R, 1, H]."""
        length = state.tokens.shape[1]
        pending = length - 1 - self.fed
        predicted = self._step(self.features[:, :pending], state.tokens[:, self.fed + 1 :], self.fed)[:, -1:]
        self.features = self.features[:, pending:]
        self.fed = length - 1
        self.forwards += 1
        return predicted

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        predicted = self._catch_up(state)
        tokens, probs = [], []
        for i in range(k):
            choice, q = self.lm_head.pick(self, self._draft_logits(predicted[:, -1:]))
            tokens.append(choice.view(1, 1))
            probs.append(q)
            if i + 1 < k:
                predicted = self._step(predicted, tokens[-1], self.fed + 1 + i)
                self.forwards += 1
        crop_cache(self.cache, self.head_cache_length)  # the drafted pairs are not committed
        return Draft(tokens=torch.cat(tokens, dim=1), probs=torch.stack(probs, dim=1) if probs[0] is not None else None)

    def describe(self) -> dict:
        return {**super().describe(), "head_layers": 1, "draft_vocabulary": self.lm_head.size}


@register_drafter("eagle2")
class Eagle2Drafter(EagleDrafter):
    """EAGLE-2 (Li et al., 2024): the EAGLE head grows a context-aware dynamic tree.

    Expand the ``top_k`` most confident nodes per layer for ``depth`` layers (confidence = product
    of the head's probabilities along the path), keep the ``num_nodes`` best of all candidates
    (:func:`mmspec.core.tree.dynamic_tree`), verify the tree in one target forward. The tree is
    deterministic (q = 1 per node), so sampling stays exact with the multi-draft rule.

    Under sampling (``sampled_children=None`` follows the generation's ``do_sample``) a top-k
    child x is accepted with probability p(x) only, so the children are instead drawn from the
    head's q at the generation's temperature / top-k / top-p, without replacement, and accepted
    with sum min(p, q) (:func:`mmspec.core.tree.sampled_dynamic_tree`: the slots' values are fixed
    before their tokens are drawn and nothing drawn is dropped, which keeps the rule exact).
    With ``num_nodes="auto"`` the depth of the first-child chain is planned before anything is
    drawn (:meth:`_chain_depth`) and every other slot is opened only while it raises the expected
    tokens per second (:meth:`_sibling_rule`).

    ``num_nodes="auto"`` (hardware-aware): grow up to ``max_nodes`` candidates, then keep the n most
    confident that maximise expected tokens per second, (1 + sum of the kept nodes' V) / (C(n + 1)
    + drafting time), with C the target's verification cost curve measured on this device
    (:mod:`mmspec.core.cost`); the mean n chosen is reported in the stats. The depth is adaptive
    too (``depth`` is then the maximum): another layer is drafted only while the most confident
    node to expand has V > c_layer / C(1), i.e. while the token it may add (worth one target
    forward, C(1)) is expected to repay the time the layer costs (c_layer: head forward + tree
    bookkeeping, timed as it runs); the mean depth drafted is in the stats. Both use the confidences
    calibrated per depth against the acceptance observed so far in the generation
    (:class:`mmspec.core.cost.DepthCalibration`). Sampled trees plan their first-child chain from
    the observed conditional acceptance per depth instead (:class:`mmspec.core.cost.ChainAcceptance`,
    :meth:`_chain_depth`).

    Each expansion runs the head once over the layer's frontier nodes: node i reads the head's
    predicted feature at its parent and its own token, and attends to the committed pairs and its
    tree ancestors (a 4-D mask over the head's cache).
    """

    def __init__(self, target_model: nn.Module, head: EagleHead, depth: int = 8, top_k: int = 8,
                 num_nodes: int | str = "auto", max_nodes: int = 64, draft_vocabulary: torch.Tensor | None = None,
                 sampled_children: bool | None = None) -> None:
        super().__init__(target_model, head, num_draft_tokens=depth, draft_vocabulary=draft_vocabulary)
        if num_nodes != "auto" and not (isinstance(num_nodes, int) and num_nodes >= 1):
            raise ValueError(f"num_nodes must be a positive int or 'auto', got {num_nodes!r}")
        self.depth, self.top_k, self.num_nodes, self.max_nodes = depth, top_k, num_nodes, max_nodes
        self.sampled_children = sampled_children
        self.cost_model: CostModel | None = None
        self.chosen_nodes: list[int] = []
        self.drafted_depths: list[int] = []
        self.layer_seconds: float | None = None  # running mean time of drafting one tree layer
        self.calibration = DepthCalibration(depth)
        self.verified_depth_sums: torch.Tensor | None = None  # sum of V per depth of the tree in verification
        self.chain_acceptance = ChainAcceptance(depth)  # sampled trees: how far the first-child chain is accepted
        # sampled trees: siblings (children after a node's first) are calibrated apart from the chain
        self.sibling_calibration = DepthCalibration(1)
        self.verified_siblings: tuple[set[int], float] | None = None  # (sibling nodes, sum of their V)
        self.sibling_accepted = False

    def start(self, context, state: SequenceState) -> None:
        super().start(context, state)
        self.chosen_nodes, self.drafted_depths = [], []
        self.calibration, self.verified_depth_sums = DepthCalibration(self.depth), None
        self.chain_acceptance = ChainAcceptance(self.depth)
        self.sibling_calibration, self.verified_siblings = DepthCalibration(1), None
        self.layer_seconds = None  # timed afresh per generation, like the rest of the drafter state
        if self.num_nodes == "auto":
            self.cost_model = CostModel(cached_verification_cost(context.target, context.model_inputs))

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        super().on_verified(num_drafted, num_accepted, target_output)
        if self.verified_depth_sums is not None and num_drafted:
            self.calibration.update(self.verified_depth_sums, num_accepted)
        if self.verified_siblings is not None:
            self.chain_acceptance.update(self.drafted_depths[-1], num_accepted)
            if self.verified_siblings[1] > 0:
                self.sibling_calibration.update(torch.tensor([0.0, self.verified_siblings[1]]), int(self.sibling_accepted))
        self.verified_depth_sums, self.verified_siblings = None, None

    def _samples_children(self) -> bool:
        """Whether this generation's trees are sampled: ``sampled_children``, else ``do_sample``."""
        if self.sampled_children is not None:
            return self.sampled_children
        return self.context is not None and self.context.sampling.do_sample

    def on_tree_verified(self, path: torch.Tensor, tree_output: TargetOutput) -> None:
        self.sibling_accepted = self.verified_siblings is not None and any(int(n) in self.verified_siblings[0] for n in path)

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "Eagle2Drafter":
        path = arg or shipped_drafter_dir(target.model, "eagle", HEAD_CONFIG, "eagle2")
        return cls(target.model, EagleHead.load(path, target.model), depth=num_draft_tokens or 8,
                   draft_vocabulary=load_draft_vocabulary(path))

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        started = time.perf_counter()
        depth = min(self.depth, max_tokens)
        sampling, sampled = self.context.sampling, self._samples_children()
        root_feature = self._catch_up(state)
        fed_nodes: list[int] = []  # candidate indices in the head cache after the committed pairs
        outputs: dict[int, torch.Tensor] = {}  # candidate -> predicted feature [H]

        def draft_probs(predicted: torch.Tensor) -> torch.Tensor:
            logits = self._draft_logits(predicted)
            return logits_to_probs(logits, sampling) if sampled else torch.softmax(logits.float(), dim=-1)

        def child_probs(candidates: TokenTree, nodes: torch.Tensor) -> torch.Tensor:
            nodes = nodes.tolist()
            parents = candidates.parents[nodes].tolist()
            features = torch.stack([root_feature[:, 0] if p < 0 else outputs[p] for p in parents], dim=1)
            tokens = self.lm_head.tokens(candidates.tokens[nodes].to(state.tokens.device))[None]
            depths = candidates.depth[nodes].to(tokens.device)
            ancestors = candidates.ancestor_matrix()
            committed = self.head_cache_length
            cached = committed + len(fed_nodes)
            allowed = torch.ones((len(nodes), cached + len(nodes)), dtype=torch.bool)
            if fed_nodes:
                allowed[:, committed:cached] = ancestors[nodes][:, fed_nodes]
            allowed[:, cached:] = torch.eye(len(nodes), dtype=torch.bool)
            dtype = root_feature.dtype
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            predicted = self.head(features, self.embed(tokens), self.cache, (committed + depths - 1)[None],
                                  attention_mask=mask[None, None].to(tokens.device))
            self.forwards += 1
            fed_nodes.extend(nodes)
            for node, feature in zip(nodes, predicted.unbind(1)):
                outputs[node] = feature  # [R, H]
            return draft_probs(predicted)

        last_call: list[float] = []

        def time_layer() -> int:
            """Update c_layer, the running mean time between two layer expansions (a layer's head
            forward + tree bookkeeping); returns the layers timed in this step so far."""
            now = time.perf_counter()
            if last_call:
                seconds = now - last_call[-1]
                self.layer_seconds = seconds if self.layer_seconds is None else 0.8 * self.layer_seconds + 0.2 * seconds
            last_call.append(now)
            return len(last_call)

        def worth_another_layer(best_log_value: float) -> bool:
            """V_max * C(1) > c_layer. Layers 2 and 3 are always drafted, so c_layer keeps being
            measured (a one-off stall cannot stop the trees for good)."""
            calls = time_layer()
            if calls <= 2:
                return True
            rho = float(self.calibration.factors()[calls + 1])  # the layer about to be drafted
            return rho * math.exp(best_log_value) * self.cost_model.forward_cost(1) > self.layer_seconds

        root_probs = draft_probs(root_feature)[0]
        auto = self.num_nodes == "auto"
        size = self.max_nodes if auto else self.num_nodes
        if not sampled:
            tree = dynamic_tree(root_probs, child_probs, depth=depth, top_k=self.top_k, num_nodes=size,
                                expand_while=worth_another_layer if auto else None)
        else:
            open_slot = None
            if auto:
                depth = self._chain_depth(depth, time.perf_counter() - started)
                open_slot = self._sibling_rule(depth, started)
            tree = sampled_dynamic_tree(root_probs, child_probs, depth=depth, top_k=self.top_k, num_nodes=size,
                                        generator=self.context.generator, open_slot=open_slot,
                                        expand_while=(lambda best: time_layer() > 0) if auto else None)  # depth planned; layers timed
        self.drafted_depths.append(tree.max_depth)
        crop_cache(self.cache, self.head_cache_length)
        tree = dataclasses.replace(tree, tokens=self.lm_head.tokens(tree.tokens.to(state.tokens.device)),  # draft indices -> ids
                                   probs=None if tree.probs is None else self.lm_head.full(tree.probs))
        if auto:
            if not sampled:  # keep the n most confident nodes (ancestor-closed prefixes) that pay
                order = torch.argsort(-tree.scores, stable=True)
                gains = tree.scores[order].exp().cpu() * self.calibration.factors()[tree.depth[order.cpu()]]
                tree = tree.select(order[: self.cost_model.best_size(gains, time.perf_counter() - started)].cpu())
            values = tree.scores.exp().float().cpu()
            if sampled:  # the chain of first children (ChainAcceptance); the siblings apart
                siblings = sorted(kid for parent in range(-1, tree.size) for kid in tree.children(parent)[1:])
                self.verified_siblings = (set(siblings), float(values[siblings].sum()))
            else:
                self.verified_depth_sums = torch.zeros(tree.max_depth + 1).index_add_(0, tree.depth, values)
        self.chosen_nodes.append(tree.size)
        if tree.size == 0:
            return Draft(tokens=state.tokens.new_empty((1, 0)))
        return Draft.from_tree(tree)

    def _chain_depth(self, max_depth: int, spent: float) -> int:
        """Sampled trees: the depth D of the first-child chain, fixed before anything is drawn.

        The chain's expected accepted tokens are s_1 + ... + s_D with s_d = P(accepted >= d) as
        observed so far (:class:`~mmspec.core.cost.ChainAcceptance`); D maximises
        (1 + sum_{d <= D} s_d) / (C(D + 1) + (D - 1) c_layer + t). At least 1, so the estimate
        keeps seeing evidence."""
        rho = self.chain_acceptance.survival()
        layer = self.layer_seconds or 0.0
        best, best_speed, gain = 1, 0.0, 1.0
        for d in range(1, max_depth + 1):
            gain += float(rho[d])
            speed = gain / (self.cost_model.forward_cost(d + 1) + (d - 1) * layer + spent)
            if speed > best_speed:
                best, best_speed = d, speed
        return best

    def _sibling_rule(self, chain_depth: int, started: float):
        """``open_slot`` for :func:`sampled_dynamic_tree`: the chain's first children (V = 1) are
        opened as planned; any other slot only while it raises the expected tokens per second of
        the whole planned tree, (1 + G + g) / (C(n + 2) + t) > (1 + G) / (C(n + 1) + t), with n and G
        the nodes and calibrated gains opened or still planned, g = rho V and t the time so far.
        Off-chain slots (siblings and their subtrees) have their own calibration: how often the
        accepted path left the chain through a sibling, per unit of sibling V drafted."""
        rho = self.chain_acceptance.survival()
        rho_sibling = float(self.sibling_calibration.factors()[1])
        planned = {"nodes": chain_depth, "gain": float(rho[1 : chain_depth + 1].sum())}

        def open_slot(log_value: float, node_depth: int) -> bool:
            if log_value == 0.0:  # the chain (V = 1 only there)
                return node_depth <= chain_depth
            gain = rho_sibling * math.exp(log_value)
            n, total, spent = planned["nodes"], 1 + planned["gain"], time.perf_counter() - started
            if (total + gain) * (self.cost_model.forward_cost(n + 1) + spent) <= total * (self.cost_model.forward_cost(n + 2) + spent):
                return False
            planned["nodes"], planned["gain"] = n + 1, planned["gain"] + gain
            return True

        return open_slot

    def describe(self) -> dict:
        chosen = {"mean_tree_nodes": round(sum(self.chosen_nodes) / len(self.chosen_nodes), 1),
                  "mean_depth_drafted": round(sum(self.drafted_depths) / len(self.drafted_depths), 1)} if self.chosen_nodes else {}
        return {**super().describe(), "tree": "dynamic, sampled children" if self._samples_children() else "dynamic", "depth": self.depth, "top_k": self.top_k,
                "num_nodes": self.num_nodes, **chosen}
