"""Tiny transformers models for ``bench/arch_sweep.py``: name -> (builder(L), input kind).

builder(L) builds the model with L layers per stack (2 in the default variant, more in the
budget variant so that a 40% budget can hold some layers resident and stream the rest)."""

from __future__ import annotations

import torch
import transformers as T

V = 64  # vocab
SEQ = 6


def dec(cls, cfg, **kw):
    base = dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64
    )

    def build(L):
        c = getattr(T, cfg)(**{**base, "num_hidden_layers": L, **kw})
        return getattr(T, cls)(c)

    return build


def _gpt2(L):
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=L, n_head=4, n_positions=64))


def _opt(L):
    return T.OPTForCausalLM(
        T.OPTConfig(
            vocab_size=V,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=L,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=16,
            pad_token_id=1,
        )
    )


def _bloom(L):
    return T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=L, n_head=4))


def _falcon(L, **kw):
    return T.FalconForCausalLM(
        T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=L, num_attention_heads=4, **kw)
    )


def _gptj(L):
    return T.GPTJForCausalLM(
        T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=L, n_head=4, rotary_dim=4, n_positions=64)
    )


def _codegen(L):
    return T.CodeGenForCausalLM(
        T.CodeGenConfig(vocab_size=V, n_embd=32, n_layer=L, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64)
    )


def _bigcode(L):
    return T.GPTBigCodeForCausalLM(
        T.GPTBigCodeConfig(vocab_size=V, n_embd=32, n_layer=L, n_head=4, n_positions=64, multi_query=True)
    )


def _gptneo(L):
    return T.GPTNeoForCausalLM(
        T.GPTNeoConfig(
            vocab_size=V,
            hidden_size=32,
            num_layers=L,
            num_heads=4,
            attention_types=[[["global", "local"], max(1, L // 2)]],
            window_size=3,
            max_position_embeddings=64,
        )
    )


def _mixtral(L):
    return T.MixtralForCausalLM(
        T.MixtralConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=L,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=1,
            sliding_window=None,
        )
    )


def _qwen2moe(L):
    return T.Qwen2MoeForCausalLM(
        T.Qwen2MoeConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_hidden_layers=L,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=1,
            decoder_sparse_step=1,
        )
    )


def _qwen3moe(L):
    return T.Qwen3MoeForCausalLM(
        T.Qwen3MoeConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=L,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=1,
            decoder_sparse_step=1,
        )
    )


def _dsv3(L):
    return T.DeepseekV3ForCausalLM(
        T.DeepseekV3Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=L,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            max_position_embeddings=64,
            rope_interleave=True,
        )
    )


#: What the BART family's tiny configurations share: two stacks of L layers.
_SEQ2SEQ = dict(
    vocab_size=V,
    d_model=32,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
)
_BART_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)


def seq2seq(cls, cfg, **kw):
    """A builder of ``cls`` with ``cfg``: :data:`_SEQ2SEQ`, ``kw`` and L layers in each stack."""

    def build(L):
        return getattr(T, cls)(getattr(T, cfg)(**_SEQ2SEQ, encoder_layers=L, decoder_layers=L, **kw))

    return build


_bart = seq2seq("BartForConditionalGeneration", "BartConfig", **_BART_IDS)
_marian = seq2seq(
    "MarianMTModel", "MarianConfig", pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0
)
_mbart = seq2seq("MBartForConditionalGeneration", "MBartConfig", **_BART_IDS)
_pegasus = seq2seq(
    "PegasusForConditionalGeneration",
    "PegasusConfig",
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)


def _whisper(L):
    return T.WhisperForConditionalGeneration(
        T.WhisperConfig(
            vocab_size=V,
            num_mel_bins=8,
            d_model=32,
            encoder_layers=L,
            decoder_layers=L,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=8,
            max_target_positions=16,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=3,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        )
    )


def _enc(cls, cfg, **kw):
    base = dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64
    )

    def build(L):
        c = getattr(T, cfg)(**{**base, "num_hidden_layers": L, **kw})
        try:
            return getattr(T, cls)(c, add_pooling_layer=False)
        except TypeError:
            return getattr(T, cls)(c)

    return build


def _distilbert(L):
    return T.DistilBertModel(
        T.DistilBertConfig(
            vocab_size=V, dim=32, n_layers=L, n_heads=4, hidden_dim=64, max_position_embeddings=64
        )
    )


def _albert(L):
    # ALBERT shares one layer group across all layers: the same module runs L (>= 3) times.
    return T.AlbertModel(
        T.AlbertConfig(
            vocab_size=V,
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=max(3, L),
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        ),
        add_pooling_layer=False,
    )


def _debertav2(L):
    return T.DebertaV2Model(
        T.DebertaV2Config(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=L,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            relative_attention=True,
            position_buckets=8,
            max_relative_positions=16,
            pos_att_type=["p2c", "c2p"],
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            position_biased_input=False,
        )
    )


def _convnext(L):
    # 2 stages; the budget variant (L > 2) deepens them and streams ConvNextLayer blocks (see UNIT)
    return T.ConvNextModel(
        T.ConvNextConfig(
            num_channels=3,
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[L // 2 if L > 2 else 1] * 2,
            patch_size=2,
            image_size=16,
        )
    )


def _swin(L):
    d = L // 2 if L > 2 else 1
    return T.SwinModel(
        T.SwinConfig(
            image_size=16,
            patch_size=2,
            num_channels=3,
            embed_dim=16,
            depths=[d, d],
            num_heads=[2, 2],
            window_size=2,
        ),
        add_pooling_layer=False,
    )


def _clip(L):
    tc = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=L,
        num_attention_heads=4,
        max_position_embeddings=16,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    vc = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=L,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
    )
    return T.CLIPModel(T.CLIPConfig(text_config=tc, vision_config=vc, projection_dim=16))


def _wav2vec2(L):
    return T.Wav2Vec2Model(
        T.Wav2Vec2Config(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=L,
            num_attention_heads=4,
            intermediate_size=64,
            conv_dim=(8, 8),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            mask_time_prob=0.0,
            do_stable_layer_norm=False,
        )
    )


def _wav2vec2_stable(L):
    return T.Wav2Vec2Model(
        T.Wav2Vec2Config(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=L,
            num_attention_heads=4,
            intermediate_size=64,
            conv_dim=(8, 8),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            mask_time_prob=0.0,
            do_stable_layer_norm=True,
            feat_extract_norm="layer",
        )
    )


def _mamba(L):
    return T.MambaForCausalLM(
        T.MambaConfig(
            vocab_size=V,
            hidden_size=32,
            state_size=4,
            num_hidden_layers=L,
            expand=2,
            conv_kernel=4,
            time_step_rank=4,
            use_mambapy=False,
        )
    )


def _switch(L):
    return T.SwitchTransformersForConditionalGeneration(
        T.SwitchTransformersConfig(
            vocab_size=V,
            d_model=32,
            d_kv=8,
            d_ff=64,
            expert_capacity=64,
            num_layers=L,
            num_decoder_layers=L,
            num_sparse_encoder_layers=1,
            num_sparse_decoder_layers=1,
            num_heads=4,
            num_experts=8,
            router_jitter_noise=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def _nllbmoe(L):
    return T.NllbMoeForConditionalGeneration(
        T.NllbMoeConfig(
            vocab_size=V,
            d_model=32,
            encoder_layers=L,
            decoder_layers=L,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_experts=8,
            expert_capacity=64,
            encoder_sparse_step=1,
            decoder_sparse_step=1,
            max_position_embeddings=64,
            router_z_loss_coef=0.0,
            router_aux_loss_coef=0.0,
            second_expert_policy="all",
            moe_token_dropout=0.0,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        )
    )


def _mpt(L):
    return T.MptForCausalLM(
        T.MptConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=L, expansion_ratio=2, max_seq_len=64)
    )


def _dinov2(L):
    return T.Dinov2Model(
        T.Dinov2Config(
            hidden_size=32,
            num_hidden_layers=L,
            num_attention_heads=4,
            mlp_ratio=2,
            image_size=16,
            patch_size=4,
        )
    )


def _beit(L):
    return T.BeitModel(
        T.BeitConfig(
            hidden_size=32,
            num_hidden_layers=L,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=16,
            patch_size=4,
            use_relative_position_bias=True,
            layer_scale_init_value=0.1,
        ),
        add_pooling_layer=False,
    )


def _segformer(L):
    return T.SegformerModel(
        T.SegformerConfig(
            num_channels=3,
            num_encoder_blocks=2,
            depths=[max(1, L // 2)] * 2,
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[3, 3],
            strides=[2, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
        )
    )


def _hubert(L):
    return T.HubertModel(
        T.HubertConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=L,
            num_attention_heads=4,
            intermediate_size=64,
            conv_dim=(8, 8),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            mask_time_prob=0.0,
        )
    )


def _jamba(L):
    return T.JambaForCausalLM(
        T.JambaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=max(L, 2),
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=4,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        )
    )


MODELS = {
    # decoders
    "gpt2": (_gpt2, "ids"),
    "opt": (_opt, "ids"),
    "bloom": (_bloom, "ids"),
    "falcon": (lambda L: _falcon(L, new_decoder_architecture=True, num_kv_heads=2), "ids"),
    "falcon-alibi": (
        lambda L: _falcon(L, alibi=True, multi_query=True, parallel_attn=False, bias=True),
        "ids",
    ),
    "gptj": (_gptj, "ids"),
    "codegen": (_codegen, "ids"),
    "gpt-bigcode": (_bigcode, "ids"),
    "gpt-neo": (_gptneo, "ids"),
    "stablelm": (
        dec(
            "StableLmForCausalLM",
            "StableLmConfig",
            num_key_value_heads=2,
            use_qkv_bias=True,
            qk_layernorm=True,
            use_parallel_residual=True,
            partial_rotary_factor=0.5,
        ),
        "ids",
    ),
    "starcoder2": (
        dec("Starcoder2ForCausalLM", "Starcoder2Config", num_key_value_heads=2, sliding_window=3),
        "ids",
    ),
    "olmo": (
        dec("OlmoForCausalLM", "OlmoConfig", pad_token_id=1, bos_token_id=0, eos_token_id=2, clip_qkv=8.0),
        "ids",
    ),
    "olmo2": (dec("Olmo2ForCausalLM", "Olmo2Config", pad_token_id=1, bos_token_id=0, eos_token_id=2), "ids"),
    "gemma2": (
        dec(
            "Gemma2ForCausalLM",
            "Gemma2Config",
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=3,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=16,
        ),
        "ids",
    ),
    "gemma3-text": (
        dec(
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=3,
            query_pre_attn_scalar=16,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=5.0,
        ),
        "ids",
    ),
    "phi3": (
        dec(
            "Phi3ForCausalLM",
            "Phi3Config",
            num_key_value_heads=2,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            sliding_window=None,
        ),
        "ids",
    ),
    "cohere": (
        dec(
            "CohereForCausalLM",
            "CohereConfig",
            num_key_value_heads=2,
            use_qk_norm=True,
            logit_scale=0.5,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
        "ids",
    ),
    "qwen3": (dec("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8), "ids"),
    "mixtral": (_mixtral, "ids"),
    "qwen2-moe": (_qwen2moe, "ids"),
    "qwen3-moe": (_qwen3moe, "ids"),
    "deepseek-v3": (_dsv3, "ids"),
    "mamba": (_mamba, "ids"),
    # encoder-decoder
    "bart": (_bart, "seq2seq"),
    "marian": (_marian, "seq2seq"),
    "whisper": (_whisper, "whisper"),
    # encoders
    "roberta": (_enc("RobertaModel", "RobertaConfig", pad_token_id=1), "ids"),
    "distilbert": (_distilbert, "ids"),
    "albert": (_albert, "ids"),
    "deberta-v2": (_debertav2, "ids"),
    "electra": (_enc("ElectraModel", "ElectraConfig", embedding_size=16), "ids"),
    "xlm-roberta": (_enc("XLMRobertaModel", "XLMRobertaConfig", pad_token_id=1), "ids"),
    # vision / multimodal / audio
    "convnext": (_convnext, "image"),
    "swin": (_swin, "image"),
    "clip": (_clip, "clip"),
    "wav2vec2": (_wav2vec2, "audio"),
    "wav2vec2-stable": (_wav2vec2_stable, "audio"),
    # extras
    "switch-transformers": (_switch, "seq2seq"),
    "nllb-moe": (_nllbmoe, "seq2seq"),
    "mbart": (_mbart, "seq2seq"),
    "pegasus": (_pegasus, "seq2seq"),
    "mpt": (_mpt, "ids"),
    "granite": (
        dec(
            "GraniteForCausalLM",
            "GraniteConfig",
            num_key_value_heads=2,
            embedding_multiplier=2.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
        ),
        "ids",
    ),
    "granitemoe": (
        dec(
            "GraniteMoeForCausalLM",
            "GraniteMoeConfig",
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=1,
        ),
        "ids",
    ),
    "olmoe": (
        dec(
            "OlmoeForCausalLM",
            "OlmoeConfig",
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
        "ids",
    ),
    "jetmoe": (
        lambda L: T.JetMoeForCausalLM(
            T.JetMoeConfig(
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=L,
                num_key_value_heads=2,
                kv_channels=8,
                intermediate_size=32,
                num_local_experts=4,
                num_experts_per_tok=1,
                max_position_embeddings=64,
            )
        ),
        "ids",
    ),
    "jamba": (_jamba, "ids"),
    "dinov2": (_dinov2, "image"),
    "beit": (_beit, "image"),
    "segformer": (_segformer, "image"),
    "hubert": (_hubert, "audio"),
}

#: unit= for the budget variant where the default units are too coarse for a 40% budget.
UNIT = {"convnext": "ConvNextLayer", "swin": "SwinLayer", "segformer": "SegformerLayer"}


def inputs(kind: str, batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    if kind == "audio":
        return {"input_values": torch.randn(batch, 400, generator=g)}
    if kind == "whisper":
        return {
            "input_features": torch.randn(batch, 8, 16, generator=g),
            "decoder_input_ids": torch.randint(3, V, (batch, 5), generator=g),
        }
    ids = torch.randint(3, V, (batch, SEQ), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(3, V, (batch, 5), generator=g)}
    if kind == "clip":
        return {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    return {"input_ids": ids}
