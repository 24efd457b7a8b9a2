"""A small decoder-only transformer (token embedding, causal attention, MLP, RMSNorm, output head) for lesson 09.

    model = tiny_transformer()          # tokens (B, T) int64 -> logits (B, T, vocab)
The vocabulary (37) is chosen so that no world size of 2-4 divides it: the embedding and the head need padding.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Attention(nn.Module):
    """(B, T, dim) -> (B, T, dim): causal multi-head self-attention from four bias-free Linear projections."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape

        def split(t):  # (B, T, heads x head_dim) -> (B, heads, T, head_dim); under tensor parallelism, local heads
            return t.view(batch, time, -1, self.head_dim).transpose(1, 2)
        attended = nn.functional.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                                              split(self.value(x)), is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, time, -1))


class Block(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)); (B, T, dim) -> (B, T, dim)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """tokens (B, T) int64 -> logits (B, T, vocab)."""

    def __init__(self, vocab: int = 37, dim: int = 24, heads: int = 2, blocks: int = 2):
        super().__init__()
        self.checkpoint_blocks = False  # True: keep each block's input only, recompute it in backward
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return self.head(self.norm(x))


def tiny_transformer(seed: int = 0, **sizes) -> TinyTransformer:
    """The same weights on every rank for one seed (the global RNG is restored after)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = TinyTransformer(**sizes)
    with torch.no_grad():  # RMSNorm starts at ones; a random scale lets a wrong norm gradient show
        for module in model.modules():
            if isinstance(module, nn.RMSNorm):
                module.weight.uniform_(0.5, 1.5)
    torch.random.set_rng_state(state)
    return model


def token_batches(steps: int, batch: int, time: int = 8, vocab: int = 37, seed: int = 0) -> list:
    """[(tokens (batch, time) int64, targets (batch, time) int64)], the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(vocab, (batch, time), generator=generator),
             torch.randint(vocab, (batch, time), generator=generator)) for _ in range(steps)]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token, in fp32 whatever the logits' dtype."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class GPTLayer(nn.Module):
    """The layer Korthikanti et al. 2022 count activations for: LayerNorm, QKV, softmax attention with dropout,
    projection, dropout, LayerNorm, h -> 4h GELU MLP, dropout. x (s, b, h) -> (s, b, h), sequence first."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attention_norm, self.mlp_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.projection = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        a = self.heads

        def split(t):  # (s, b, h) -> (b a, s, h / a)
            return t.reshape(s, b * a, h // a).transpose(0, 1)
        q, k, v = self.qkv(self.attention_norm(x)).chunk(3, dim=-1)
        scores = torch.bmm(split(q), split(k).transpose(1, 2)) * (h // a) ** -0.5
        probabilities = nn.functional.dropout(scores.softmax(-1), self.dropout)
        context = torch.bmm(probabilities, split(v)).transpose(0, 1).reshape(s, b, h)
        x = x + nn.functional.dropout(self.projection(context), self.dropout)
        mlp = self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))
        return x + nn.functional.dropout(mlp, self.dropout)
