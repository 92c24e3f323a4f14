"""The hints one forward shows (:mod:`annot.rewriters.analysis.head_flow`),
source in, hints out: the attention and MLP forms of nanoGPT, torch's test
Transformer, timm, x-transformers (einops), Hugging Face (a shape tuple, -1
heads, a qk norm), and what must stay whole, with its reason."""

import textwrap

import pytest

from annot.core.specs import Col, Replicate, Row
from annot.rewriters.analysis.head_flow import Children, read_flow


def _flow(source: str, **kids):
    return read_flow(
        textwrap.dedent(source), Children(**{k: frozenset(v) for k, v in kids.items()})
    )


CASES = {
    "nanogpt attention": (
        """
        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            if self.flash:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
                att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
                y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))
        """,
        dict(linears={"c_attn", "c_proj"}, elementwise={"attn_dropout", "resid_dropout"}),
        {"c_attn": Col(chunks=3), "c_proj": Row()},
        ("n_embd", "n_head", "C"),
    ),
    "gated mlp": (
        """
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        """,
        dict(linears={"gate_proj", "up_proj", "down_proj"}, elementwise={"act_fn"}),
        {"gate_proj": Col(), "up_proj": Col(), "down_proj": Row()},
        (),
    ),
    "mlp through a module dict and F.silu": (
        """
        def forward(self, h):
            h = h + self.attn(self.norm1(h))
            return h + self.ff["down"](F.silu(self.ff["up"](self.norm2(h))))
        """,
        dict(linears={"ff.up", "ff.down"}, weighted={"attn", "norm1", "norm2"}),
        {"ff.up": Col(), "ff.down": Row()},
        (),
    ),
    "timm: (3, heads, head_dim) in one reshape": (
        """
        def forward(self, x):
            B, N, C = x.shape
            qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            x = F.scaled_dot_product_attention(q, k, v)
            return self.proj(x.transpose(1, 2).reshape(B, N, C))
        """,
        dict(linears={"qkv", "proj"}),
        {"qkv": Col(chunks=3), "proj": Row()},
        ("heads", "C"),
    ),
    "einops, a head count copied to a local": (
        """
        def forward(self, x):
            h = self.heads
            q, k, v = self.to_qkv(x).chunk(3, dim=-1)
            q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=h) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v)
            return self.to_out(rearrange(out, "b h n d -> b n (h d)"))
        """,
        dict(linears={"to_qkv"}, sequences={"to_out"}, weighted={"to_out"}),
        {"to_qkv": Col(chunks=3), "to_out.0": Row()},
        ("heads",),
    ),
    "hugging face: a shape tuple, -1 heads, a qk norm, a cache": (
        """
        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kw):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx)
            out, weights = attention_interface(self, q, k, v, attention_mask, **kw)
            out = out.reshape(*input_shape, -1).contiguous()
            return self.o_proj(out), weights
        """,
        dict(linears={"q_proj", "k_proj", "v_proj", "o_proj"}, weighted={"q_norm"}),
        {
            "q_proj": Col(),
            "k_proj": Col(),
            "v_proj": Col(),
            "o_proj": Row(),
            "q_norm": Replicate(sum_grad=True),
        },
        (),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reads_the_hints_a_person_would_write(name):
    source, kids, specs, local = CASES[name]
    flow = _flow(source, **kids)
    assert flow.specs == specs, flow.notes
    assert set(flow.local) == set(local)
    assert not flow.notes


LEFT_WHOLE = {
    "an LM head's logits reach the loss": (
        """
        def forward(self, x, targets):
            logits = self.head(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        """,
        dict(linears={"head"}),
        "self.head: left whole: a reshape of a column output that splits no heads at <forward>:4:28",
    ),
    "a norm over the sharded width": (
        """
        def forward(self, x):
            return self.fc2(self.norm(self.fc1(x)))
        """,
        dict(linears={"fc1", "fc2"}, weighted={"norm"}),
        "self.fc1: left whole: self.norm is applied to a sharded value at <forward>:3:21",
    ),
    "a raw parameter read with the heads": (
        """
        def forward(self, x):
            B, T, C = x.shape
            q = self.q(x).view(B, T, self.heads, -1)
            return self.o((q * self.head_scale).reshape(B, T, C))
        """,
        dict(linears={"q", "o"}, params={"head_scale"}),
        "self.q: left whole: a raw parameter is read with a sharded value at <forward>:5:20",
    ),
    "heads split by a helper method": (
        """
        def forward(self, x):
            q = self._split_heads(self.q(x), self.num_heads)
            return self.o(self._merge_heads(q))
        """,
        dict(linears={"q", "o"}),
        "self.q: left whole: self._split_heads is applied to a sharded value at <forward>:3:9",
    ),
    "unequal parts (grouped keys and values)": (
        """
        def forward(self, x):
            q, k, v = self.c_attn(x).split([self.d, self.kv, self.kv], dim=-1)
            return self.c_proj(q)
        """,
        dict(linears={"c_attn", "c_proj"}),
        "self.c_attn: left whole: a split into unequal parts at <forward>:3:15",
    ),
    "a learned scale through an op (its gradient would be partial)": (
        """
        def forward(self, x):
            h = F.gelu(self.fc1(x))
            h = h * self.alpha.exp()
            return self.fc2(h)
        """,
        dict(linears={"fc1", "fc2"}, params={"alpha"}),
        "self.fc1: left whole: a raw parameter is read with a sharded value at <forward>:4:9",
    ),
    "a child's parameter, in place": (
        """
        def forward(self, x):
            h = self.fc1(x)
            h *= self.gate.alpha
            return self.fc2(h)
        """,
        dict(linears={"fc1", "fc2"}, weighted={"gate"}),
        "self.fc1: left whole: a raw parameter is read with a sharded value at <forward>:4:5",
    ),
    "a sharded value returned second": (
        """
        def forward(self, x):
            h = F.gelu(self.fc1(x))
            return self.fc2(h), h
        """,
        dict(linears={"fc1", "fc2"}),
        "self.fc1: left whole: a sharded value is returned at <forward>:4:5",
    ),
    "either branch of an if": (
        """
        def forward(self, x):
            h = F.gelu(self.fc1(x))
            if self.training:
                s = h
            else:
                s = x
            self.aux = s.pow(2).mean()
            return self.fc2(h)
        """,
        dict(linears={"fc1", "fc2"}),
        "self.fc1: left whole: .mean() on a sharded value at <forward>:8:16",
    ),
    "a one-line suite": (
        """
        def forward(self, x):
            h = self.fc1(x)
            if self.unit: h = h / h.norm(dim=-1, keepdim=True)
            return self.fc2(h)
        """,
        dict(linears={"fc1", "fc2"}),
        "self.fc1: left whole: .norm() on a sharded value at <forward>:4:27",
    ),
    "a norm on the heads and on a replicated value": (
        """
        def forward(self, x):
            B, T, C = x.shape
            q = self.norm(self.q(x).view(B, T, -1, self.d))
            y = self.o(q.reshape(B, T, -1))
            return y + self.norm(x.view(B, T, -1, self.d)).reshape(B, T, C)
        """,
        dict(linears={"q", "o"}, weighted={"norm"}),
        "self.q: left whole: self.norm runs on its heads and on a replicated value",
    ),
}


@pytest.mark.parametrize("name", list(LEFT_WHOLE))
def test_what_it_cannot_follow_stays_whole_with_the_reason(name):
    source, kids, note = LEFT_WHOLE[name]
    flow = _flow(source, **kids)
    assert not any(isinstance(s, (Col, Row)) for s in flow.specs.values()), flow.specs
    assert note in flow.notes, flow.notes


def test_a_method_forward_calls_is_read_where_it_is_called():
    """GPT-Neo's ``_split_heads(tensor, num_heads, head_dim)``: the head count
    is the call's ``self.num_heads``, so ``Local('num_heads')``."""
    from annot.rewriters.analysis.method_syntax import parse_method

    helpers = {
        "_split_heads": """
            def _split_heads(self, tensor, num_heads, attn_head_size):
                new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
                return tensor.view(new_shape).permute(0, 2, 1, 3)
            """,
        "_merge_heads": """
            def _merge_heads(self, tensor, num_heads, attn_head_size):
                tensor = tensor.permute(0, 2, 1, 3).contiguous()
                new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
                return tensor.view(new_shape)
            """,
    }
    forward = """
        def forward(self, hidden_states):
            q = self._split_heads(self.q_proj(hidden_states), self.num_heads, self.head_dim)
            k = self._split_heads(self.k_proj(hidden_states), self.num_heads, self.head_dim)
            v = self._split_heads(self.v_proj(hidden_states), self.num_heads, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v)
            out = self._merge_heads(out, self.num_heads, self.head_dim)
            return self.out_proj(out)
        """
    flow = read_flow(
        textwrap.dedent(forward),
        Children(linears=frozenset({"q_proj", "k_proj", "v_proj", "out_proj"})),
        methods=lambda name: (
            parse_method(textwrap.dedent(helpers[name])) if name in helpers else None
        ),
    )
    assert flow.specs == {"q_proj": Col(), "k_proj": Col(), "v_proj": Col(), "out_proj": Row()}
    assert flow.local == ("num_heads",)
