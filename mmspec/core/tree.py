"""Token trees: many draft continuations verified in one target forward.

A tree of N draft tokens hangs below the last committed token (the *root*, which is not a node).
Node i carries ``tokens[i]`` and ``parents[i]`` (the index of its parent node, -1 for a child of
the root); nodes are stored in topological order (``parents[i] < i``) and the children of a node
are tried by verification in index order, so a drafter lists its likelier children first.

The target scores every node at once: the inputs [root, node_0 .. node_{N-1}] get a tree attention
mask (each input sees the cached prefix, its ancestors and itself; :func:`tree_attention_mask`)
and position ids by depth (:func:`tree_position_ids`), passed through transformers' public
``attention_mask`` (4-D, additive) and ``position_ids`` arguments. Verification walks the tree
(``mmspec.core.verify.tree_greedy_verify`` / ``tree_speculative_verify``) and the cache keeps
only the accepted path (``SequenceState.compact``).

Construction:

* static trees (Medusa; Cai et al. 2024): :meth:`TokenTree.from_paths` from index paths such as
  ``[(0,), (1,), (0, 0), (0, 1)]`` -- path ``(a, b)`` is the b-th child of the a-th child of the root;
* dynamic trees (EAGLE-2; Li et al. 2024): :func:`dynamic_tree` expands the nodes of highest
  cumulative draft confidence, reranks every candidate and keeps the best N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

ROOT = -1


@dataclass
class TokenTree:
    """A tree of draft tokens below the last committed token.

    Attributes:
        tokens: LongTensor [N] drafted tokens (or [B, N]: B trees of one shape, as the rules' tests
            batch them).
        parents: LongTensor [N] parent node of each node, -1 for a child of the root; parents[i] < i.
        probs: [N, V] (or [B, N, V]) the full draft distribution q that node i's token was drawn
            from, i.e. q(. | root, ancestors of i); siblings drawn from one distribution share the
            row. None for a deterministic tree (top-k, n-gram, EAGLE-2): q = 1 on each node's token.
        scores: [N] cumulative draft log-confidence sum_{a in path(i)} log q(a) (dynamic trees), or None.
        depth: LongTensor [N] (derived) number of tokens from the root to node i, inclusive: a child
            of the root has depth 1, so node i is the depth[i]-th token after the root.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    depth: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).cpu()  # structure stays on the host
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long)
        if self.parents.dim() != 1:
            raise ValueError(f"parents must be 1-D [N], got shape {tuple(self.parents.shape)}")
        n = self.parents.shape[0]
        if self.tokens.shape[-1] != n or self.tokens.dim() not in (1, 2):
            raise ValueError(f"tokens must be [N] or [B, N] with N = {n}, got shape {tuple(self.tokens.shape)}")
        if self.probs is not None and self.probs.shape[:-1] != self.tokens.shape:
            raise ValueError(
                f"probs must be [*tokens.shape, V], got {tuple(self.probs.shape)} for tokens {tuple(self.tokens.shape)}"
            )
        depth: list[int] = []  # on host lists (a tree has tens of nodes): parents come before their children
        for i, parent in enumerate(self.parents.tolist()):
            if not ROOT <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; nodes must be topologically ordered (-1 <= parent < index)")
            depth.append(1 if parent == ROOT else depth[parent] + 1)
        self.depth = torch.tensor(depth, dtype=torch.long)
        self._children: list[list[int]] | None = None  # built on first use (children, sibling_groups)
        self._groups: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _child_lists(self) -> list[list[int]]:
        """Children of each input row (row 0 = the root, row 1 + i = node i), in try order."""
        if self._children is None:
            self._children = [[] for _ in range(self.size + 1)]
            for i, parent in enumerate(self.parents.tolist()):
                self._children[parent + 1].append(i)
        return self._children

    # structure ------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """N, the number of nodes."""
        return self.parents.shape[0]

    @property
    def max_depth(self) -> int:
        """D, the depth of the deepest node (0 for an empty tree)."""
        return int(self.depth.max()) if self.size else 0

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1: of the root), in the order verification tries them."""
        return list(self._child_lists()[node + 1])

    def best(self, num_nodes: int) -> "TokenTree":
        """EAGLE-2's rerank: the ``num_nodes`` nodes of highest ``scores``, ties to the earlier
        node. A dynamic tree's log V never rises along a path and parents come before their
        children, so the set is ancestor-closed."""
        return self.select(torch.argsort(-self.scores, stable=True)[:num_nodes])

    def select(self, nodes: torch.Tensor) -> "TokenTree":
        """The sub-tree of ``nodes`` (LongTensor [n], ancestor-closed: every kept node's parent is
        kept), in the original node order."""
        kept = torch.as_tensor(nodes, dtype=torch.long).cpu().sort().values
        new_index = torch.full((self.size,), ROOT, dtype=torch.long)
        new_index[kept] = torch.arange(len(kept))
        parents = self.parents[kept]
        if bool(((parents != ROOT) & (new_index[parents.clamp(min=0)] == ROOT)).any()):
            raise ValueError("select() needs an ancestor-closed set of nodes")
        parents = torch.where(parents == ROOT, ROOT, new_index[parents.clamp(min=0)])
        device = self.tokens.device
        return TokenTree(
            self.tokens[..., kept.to(device)], parents,
            probs=None if self.probs is None else self.probs[..., kept.to(device), :],
            scores=None if self.scores is None else self.scores[kept.to(self.scores.device)],
        )

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def sibling_groups(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Nodes grouped by their rank among their siblings.

        Returns:
            For rank j = 0 .. (most children of any row) - 1: (nodes [n_j], rows [n_j]) where nodes
            are the j-th child of each input row that has one and rows = parents[nodes] + 1 (the
            target row scoring them). Rows are distinct within a group, so a verification rule can
            process all nodes of one rank in parallel.
        """
        if self._groups is None:
            groups = []
            children = self._child_lists()
            for rank in range(max(map(len, children))):
                nodes = torch.tensor([kids[rank] for kids in children if len(kids) > rank], dtype=torch.long)
                groups.append((nodes, self.parents[nodes] + 1))
            self._groups = groups
        return self._groups

    def ancestor_matrix(self) -> torch.Tensor:
        """BoolTensor [N, N]: A[i, j] = node j is node i or one of its ancestors."""
        matrix = torch.eye(self.size, dtype=torch.bool)
        for level in range(2, self.max_depth + 1):  # one vectorised update per depth, shallow first
            nodes = torch.nonzero(self.depth == level).flatten()
            matrix[nodes] |= matrix[self.parents[nodes]]  # the parents' rows are complete already
        return matrix

    def ancestor_rows(self, nodes: list[int], columns: list[int]) -> torch.Tensor:
        """BoolTensor [len(nodes), len(columns)]: node ``columns[j]`` is ``nodes[i]`` or one of its
        ancestors (the rows and columns of :meth:`ancestor_matrix` that a drafter's expansion needs,
        walked up the parents: cheaper than the whole matrix for a few nodes)."""
        parents, where = self.parents.tolist(), {node: j for j, node in enumerate(columns)}
        rows = [[False] * len(columns) for _ in nodes]  # (host lists, one tensor at the end)
        for row, node in zip(rows, nodes):
            while node != ROOT:
                if node in where:
                    row[where[node]] = True
                node = parents[node]
        return torch.tensor(rows, dtype=torch.bool).reshape(len(nodes), len(columns))

    @classmethod
    def grown(cls, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
              scores: torch.Tensor | None = None) -> "TokenTree":
        """A tree whose ``depth`` [N] its builder kept as it grew (parents [N] on the host and
        topological by construction): none of the checks and depth walk of the constructor."""
        tree = cls.__new__(cls)
        tree.tokens, tree.parents, tree.probs, tree.scores, tree.depth = tokens, parents, None, scores, depth
        tree._children = tree._groups = None
        return tree

    def is_chain(self) -> bool:
        """True if every node's parent is the previous node (a linear draft)."""
        return torch.equal(self.parents, torch.arange(-1, self.size - 1))

    def prepend_root(self, token: torch.Tensor | int) -> "TokenTree":
        """The tree with the root itself as node 0 (every old node shifts by one).

        This is the layout of a verification forward: the inputs are [root, node_0 .. node_{N-1}]
        and the root (the last committed token, not yet in the cache) is the parent of the old
        root children. ``probs`` and ``scores`` are dropped (the forward needs only the shape).
        """
        token = torch.as_tensor(token, dtype=torch.long, device=self.tokens.device).reshape(*self.tokens.shape[:-1], 1)
        parents = torch.cat([torch.tensor([ROOT]), torch.where(self.parents == ROOT, 0, self.parents + 1)])
        return TokenTree(torch.cat([token, self.tokens], dim=-1), parents)

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_paths(
        cls,
        paths: Sequence[Sequence[int]],
        tokens: torch.Tensor | Sequence[int],
        probs: torch.Tensor | None = None,
    ) -> "TokenTree":
        """A static tree (Medusa) from index paths.

        Path ``(a, b, c)`` is the c-th child of the b-th child of the a-th child of the root. Nodes
        are ordered by (depth, path), so parents precede children and siblings are tried in the
        order of their last index. Every proper prefix of a path must be a path too.

        Args:
            paths: N distinct non-empty index paths, e.g. ``[(0,), (1,), (0, 0), (0, 1), (1, 0)]``.
            tokens: [N] (or [B, N]) the token of each path, aligned with ``paths`` as given. For
                Medusa heads with top-k candidates ``cand`` [D, k]: token(p) = cand[len(p) - 1, p[-1]].
            probs: [N, V] (or [B, N, V]) draft distributions aligned with ``paths``, or None.
        Raises:
            ValueError: for duplicate paths or a path whose parent path is missing.
        Example:
            >>> TokenTree.from_paths([(0,), (1,), (0, 0)], [5, 7, 9]).parents
            tensor([-1, -1,  0])
        """
        keyed = [tuple(int(i) for i in p) for p in paths]
        if len(set(keyed)) != len(keyed):
            raise ValueError("paths must be distinct")
        if any(len(p) == 0 for p in keyed):
            raise ValueError("paths must be non-empty (the root is not a node)")
        order = sorted(range(len(keyed)), key=lambda i: (len(keyed[i]), keyed[i]))
        index_of = {keyed[i]: rank for rank, i in enumerate(order)}
        parents = []
        for i in order:
            path = keyed[i]
            if len(path) == 1:
                parents.append(ROOT)
            elif path[:-1] in index_of:
                parents.append(index_of[path[:-1]])
            else:
                raise ValueError(f"path {path} has no parent path {path[:-1]}")
        permutation = torch.tensor(order, dtype=torch.long)
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        tokens = tokens.index_select(-1, permutation.to(tokens.device))
        if probs is not None:
            probs = probs.index_select(-2, permutation.to(probs.device))
        return cls(tokens, torch.tensor(parents, dtype=torch.long), probs)

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: torch.Tensor | None = None) -> "TokenTree":
        """A linear draft as a tree: tokens [K] (or [B, K]), probs [K, V] (or [B, K, V]) or None."""
        return cls(tokens, torch.arange(-1, tokens.shape[-1] - 1), probs)


ChildProbs = Callable[[TokenTree, torch.Tensor], torch.Tensor]


def top_log(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q, index) of the k largest q of each row of probs [..., V], largest first, ties to the
    lower index (a stable sort: ``torch.topk`` leaves the order of ties open, and a bf16 head's
    probabilities tie often), q floored at 1e-30 before the log."""
    values, indices = torch.sort(probs.float().clamp_min(1e-30).log(), dim=-1, descending=True, stable=True)
    k = min(k, probs.shape[-1])
    return values[..., :k], indices[..., :k]


def dynamic_tree(
    root_probs: torch.Tensor,
    child_probs: ChildProbs,
    depth: int,
    top_k: int,
    num_nodes: int,
    expand_while: Callable[[float], bool] | None = None,
) -> TokenTree:
    """EAGLE-2's context-aware dynamic draft tree (Li et al. 2024), deterministic (q = 1 per node).

    The value of a candidate node is its cumulative draft confidence
    V(i) = prod_{a in path(i)} c(a), c(a) = q(a | ancestors of a); we work with log V.

    1. Expand: the root's top_k tokens form layer 1. For layers 2 .. ``depth``: the top_k nodes of
       the previous layer by V are expanded (``child_probs`` gives their next-token draft
       distributions), each contributes its top_k tokens as candidates (top_k^2 per layer), and
       the top_k of these by V are the next layer's nodes to expand.
    2. Rerank: of all candidates, keep the ``num_nodes`` with the highest V. Since c <= 1, a child
       never beats its parent (ties go to the earlier node, and parents are created first), so the
       kept set contains every kept node's ancestors and is a tree.

    Args:
        root_probs: [V] draft distribution after the committed tokens.
        child_probs: ``(candidates, nodes) -> [n, V]``: the draft distribution after each node of
            ``nodes`` (LongTensor [n], indices into ``candidates``, the tree of every candidate so
            far, with ``scores``). A drafter runs its network here, e.g. with
            :func:`tree_attention_mask` over ``candidates``.
        depth: number of layers to expand (EAGLE-2: 5-6).
        top_k: branching factor of the expansion (EAGLE-2: 10).
        num_nodes: N, nodes kept after reranking (EAGLE-2: ~60).
        expand_while: optional early stop: before expanding layer d >= 2 it gets the highest
            log V of the nodes about to be expanded, and layer d is only drafted if it returns
            True (``depth`` is then the maximum depth).
    Returns:
        TokenTree with ``probs=None`` and ``scores`` = log V; nodes in creation order (topological,
        siblings by decreasing confidence).
    """
    if depth < 1 or top_k < 1 or num_nodes < 1:
        raise ValueError(f"depth, top_k and num_nodes must be >= 1, got {depth}, {top_k}, {num_nodes}")
    device = root_probs.device
    log_conf, tokens = top_log(root_probs, top_k)
    all_tokens, all_parents, all_scores = [tokens], [torch.full_like(tokens, ROOT).cpu()], [log_conf]
    all_depths = [torch.ones(tokens.shape[0], dtype=torch.long)]
    frontier = torch.arange(tokens.shape[0], device=device)  # nodes to expand next
    count = tokens.shape[0]
    for _ in range(depth - 1):
        if expand_while is not None and not expand_while(float(torch.cat(all_scores)[frontier].max())):
            break
        depths, expanded = torch.cat(all_depths), frontier.cpu()  # (the tree's structure stays on the host)
        candidates = TokenTree.grown(torch.cat(all_tokens), torch.cat(all_parents), depths, torch.cat(all_scores))
        probs = child_probs(candidates, expanded)  # [n, V]
        child_log, child_tokens = top_log(probs, top_k)
        scores = (candidates.scores.to(device)[frontier].unsqueeze(1) + child_log).flatten()  # [n * k]
        all_tokens.append(child_tokens.flatten())
        all_parents.append(expanded.repeat_interleave(child_tokens.shape[1]).to(torch.long))
        all_depths.append((depths[expanded] + 1).repeat_interleave(child_tokens.shape[1]))
        all_scores.append(scores)
        best = torch.argsort(-scores, stable=True)[:top_k]
        frontier = count + best.sort().values
        count += scores.shape[0]
    return TokenTree(torch.cat(all_tokens), torch.cat(all_parents).cpu(), scores=torch.cat(all_scores)).best(num_nodes)


def sampled_dynamic_tree(
    root_probs: torch.Tensor,
    child_probs: ChildProbs,
    depth: int,
    top_k: int,
    num_nodes: int,
    generator: torch.Generator,
    open_slot: Callable[[float, int], bool] | None = None,
    expand_while: Callable[[float], bool] | None = None,
) -> TokenTree:
    """A dynamic draft tree for sampling: EAGLE-2's best-first growth with children *drawn* from q.

    Under sampling a deterministic top-k child x is accepted with probability p(x), a child drawn
    from q with sum_x min(p(x), q(x)) (p ~ q makes that close to 1), so this tree keeps the drafts
    of sampled chains and adds siblings. The children of node u are a sample without replacement
    from q_u (Gumbel-top-m): child j is drawn from q_u with children 1..j-1 removed and
    renormalised, and that row is stored as its q_j, which is what the multi-draft rule of
    :func:`mmspec.core.verify.tree_speculative_verify` needs (reject x_j: p <- norm(max(0, p - q_j))).

    Exactness needs every inclusion decision to be a stopping rule: whether slot j of u (its j-th
    child) is opened may depend on anything drawn before, never on the token it will hold. So a
    slot's value is fixed before its token is drawn,

        V(u, 1) = V(u),    V(u, j) = V(u) q_u,(j) for j >= 2    (q_u,(j): the j-th largest of q_u):

    a first child drawn from q is accepted with probability sum min(p, q), which is 1 when q is
    right (a drafter scales V per depth by the acceptance it observes; EAGLE-2's top-k
    confidence q_u,(1) would badly understate a flat but accurate q), and a sibling only
    matters where p has mass q missed, guessed here as the top-k tree's confidence. Slots are
    opened per layer best first (at most ``top_k`` per layer, siblings in order), every opened node
    stays, and the next layer expands all of them. (EAGLE-2's rerank of drawn
    candidates would let a node's own token decide whether it is kept.)

    Args:
        root_probs: [V] q after the committed tokens.
        child_probs: as for :func:`dynamic_tree`: ``(candidates, nodes) -> [n, V]`` q after each node.
        depth: maximum number of layers.
        top_k: slots considered per parent and opened per layer.
        num_nodes: maximum nodes in the tree.
        generator: randomness of the draws.
        open_slot: optional ``(log V, depth) -> bool`` asked before each slot is opened (in order
            of decreasing V within a layer); False closes the layer.
        expand_while: as for :func:`dynamic_tree`, asked before each layer after the first.
    Returns:
        TokenTree with ``probs`` [N, V] (each node's q_j) and ``scores`` = log V.
    """
    if depth < 1 or top_k < 1 or num_nodes < 1:
        raise ValueError(f"depth, top_k and num_nodes must be >= 1, got {depth}, {top_k}, {num_nodes}")
    device = root_probs.device
    all_tokens, all_parents, all_probs, all_scores = [], [], [], []
    parents = torch.tensor([ROOT])  # the layer's nodes to expand (ROOT for layer 1)
    parent_scores = torch.zeros(1, dtype=torch.float32, device=device)
    probs = root_probs.float().unsqueeze(0)  # [n, V] q after each of them
    count = 0
    for layer in range(depth):
        if layer:
            if not len(parents) or (expand_while is not None and not expand_while(float(parent_scores.max()))):
                break
            candidates = TokenTree(torch.cat(all_tokens), torch.cat(all_parents), scores=torch.cat(all_scores))
            probs = child_probs(candidates, parents).float()
        k = min(top_k, probs.shape[-1])
        top = probs.topk(k, dim=-1).values
        top[:, 0] = (top[:, 0] > 0).float()  # the first child: V(u) (the slot is empty only if q is)
        values = parent_scores.unsqueeze(1) + top.clamp_min(0).log()  # [n, k], log V of slot (u, j)
        flat = values.flatten().tolist()
        order = torch.argsort(-values.flatten(), stable=True)[: min(top_k, num_nodes - count)]  # ties: parent, then j
        opened = torch.zeros(len(parents), dtype=torch.long)  # slots opened per parent (a prefix of j)
        for slot in order.tolist():
            value = flat[slot]
            if value == float("-inf") or (open_slot is not None and not open_slot(value, layer + 1)):
                break
            opened[slot // k] += 1
        if not int(opened.sum()):
            break
        layer_tokens, layer_parents, layer_probs, layer_scores = [], [], [], []
        for row in torch.nonzero(opened).flatten().tolist():
            m = int(opened[row])
            q = probs[row]
            uniforms = torch.rand(q.shape, dtype=torch.float32, generator=generator, device=generator.device).to(device).clamp_(1e-20, 1 - 1e-7)
            drawn = (q.log() - (-uniforms.log()).log()).topk(m).indices  # a sample without replacement, in draw order
            removed = torch.zeros_like(q)
            for token in drawn.tolist():
                layer_probs.append(q.masked_fill(removed.bool(), 0.0) / (1.0 - float(q[removed.bool()].sum())))
                removed[token] = 1.0
            layer_tokens.append(drawn)
            layer_parents.append(torch.full((m,), int(parents[row]), dtype=torch.long))
            layer_scores.append(values[row, :m])
        new_nodes = torch.arange(count, count + int(opened.sum()))
        count += len(new_nodes)
        all_tokens.append(torch.cat(layer_tokens))
        all_parents.append(torch.cat(layer_parents))
        all_probs.append(torch.stack(layer_probs))
        all_scores.append(torch.cat(layer_scores))
        parents, parent_scores = new_nodes, all_scores[-1]
    if not count:
        return TokenTree(root_probs.new_empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                         probs=root_probs.new_empty(0, root_probs.shape[-1]), scores=root_probs.new_empty(0))
    return TokenTree(torch.cat(all_tokens), torch.cat(all_parents), probs=torch.cat(all_probs), scores=torch.cat(all_scores))


def tree_attention_mask(
    tree: TokenTree, prefix_length: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Additive 4-D attention mask for a forward over the tree's N nodes after ``prefix_length``
    cached tokens.

    mask[0, 0, i, j] = 0 if j < prefix_length (the prefix) or node j - prefix_length is node i or
    an ancestor of node i; finfo(dtype).min otherwise. The shape [1, 1, N, prefix + N] is what
    transformers takes as a ready-made ``attention_mask`` (returned unchanged by its mask
    builders) for eager and sdpa attention.

    Args:
        tree: the N nodes being fed (for a verification forward, ``tree.prepend_root(last_token)``).
        prefix_length: tokens already in the KV cache.
        dtype: the model's compute dtype.
    Returns:
        FloatTensor [1, 1, N, prefix_length + N].
    """
    n = tree.size
    visible = torch.cat([torch.ones(n, prefix_length, dtype=torch.bool), tree.ancestor_matrix()], dim=1)
    mask = torch.zeros(n, prefix_length + n, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, n, prefix_length + n).to(device or tree.tokens.device)


def expansion_mask(seen: torch.Tensor, committed: int, dtype: torch.dtype,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Additive 4-D mask of a drafter head's forward that expands a tree a depth at a time (EAGLE-2):
    its cache holds ``committed`` positions and then the m tree nodes fed earlier, in that order;
    the forward feeds n nodes. Node i sees the committed positions, the fed nodes that are its
    ancestors, and itself.

    Args:
        seen: BoolTensor [n, m]: fed node j is an ancestor of fed node i
            (:meth:`TokenTree.ancestor_rows`).
    Returns:
        [1, 1, n, committed + m + n], 0 where visible, finfo(dtype).min elsewhere.
    """
    n, fed = seen.shape
    cached = committed + fed
    allowed = torch.ones((n, cached + n), dtype=torch.bool)
    allowed[:, committed:cached] = seen
    allowed[:, cached:] = torch.eye(n, dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def tree_position_ids(tree: TokenTree, start: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids of the nodes: start + depth - 1, so the root's children sit at ``start``.

    Returns:
        LongTensor [1, N].
    """
    return (start + tree.depth - 1).view(1, -1).to(device or tree.tokens.device)
