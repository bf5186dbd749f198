"""Generation on CUDA: the decode step captured in a CUDA graph gives the tokens of the same
step run eagerly, on both layer backends, for each tier that says it never waits for the host;
in fp32 on the PyTorch backend both are transformers' greedy tokens."""

import contextlib

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.registry import make_tier
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TE, TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.te_support import te_available
from te_mixtral.training.generate import greedy_generate
from te_mixtral.training.hf_checkpoint import load_hf_weights

pytestmark = pytest.mark.cuda
SINGLE = Layout(0, 1, 1, None, None)
CUDA = torch.device("cuda")
BACKENDS = [TORCH] + ([TE] if te_available() else [])
# device_mxfp8 does not offer graphs (its graphed decode gave other tokens than its eager one
# on an H200): `generate_text` decodes it eagerly.
CASES = [(torch.float32, "custom_grouped"), (torch.bfloat16, "custom_grouped")]


@pytest.mark.parametrize("dtype, tier", CASES, ids=lambda c: str(c).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_the_graphed_decode_step_gives_the_eager_tokens(dtype, tier, backend, tmp_path):
    cfg = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                        num_experts_per_tok=2, eos_token_id=None, bos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = MixtralForCausalLM(cfg).cuda().eval()
    hf.save_pretrained(tmp_path)
    expert_tier = make_tier(tier)
    expert_tier.check_available(CUDA)
    assert expert_tier.sync_free()
    with torch.device("cuda"):
        ours = Ours(model_config_from_hf(tmp_path), backend, SINGLE, expert_tier).to(dtype).eval()
    load_hf_weights(ours, tmp_path, SINGLE)
    prompt = torch.randint(0, 512, (9,)).tolist()

    def generate(graphs: bool) -> list[int]:
        return greedy_generate(ours, prompt, 24, -1, SINGLE, CUDA, contextlib.nullcontext(), 1024, graphs)

    eager = generate(graphs=False)
    assert generate(graphs=True) == eager and len(eager) == 24
    if dtype == torch.float32 and tier == "custom_grouped" and backend is TORCH:  # where rounding differs least
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False)
        assert out[0, len(prompt):].tolist() == eager
