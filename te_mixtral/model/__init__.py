"""The Mixtral model: a decoder whose numerics equal Hugging Face `MixtralForCausalLM`, with
the expert FFN left to the tier a run names (te_mixtral/experts/).

Shape suffixes: see te_mixtral/__init__.py.

    mixtral.py            the decoder: embeddings, attention and MoE blocks, the LM head
    layers.py             two layer backends behind one switch: Transformer Engine or PyTorch
    packed_projection.py  q, k and v by one GEMM each way, the TE backend's (weights kept apart)
    moe.py                the sparse MoE block: route, dispatch, run the expert tier, combine
    router_losses.py      Mixtral's load-balancing loss and ST-MoE's router z-loss, over ranks
    lora.py               LoRA: low-rank adapters over a frozen base
    recompute.py          activation recompute (`train.recompute`)
    kv_cache.py           generation's KV cache (training/generate.py)
    hf_config.py          our ModelConfig to and from transformers' MixtralConfig; a checkpoint's folder (a hub id's downloaded)
    hf_model.py           the `hf` baselines: transformers' MixtralForCausalLM as is
"""
