"""Tiny configs of every mlx-lm family with routed experts (``SwitchGLU`` /
``SwitchMLP``), for tests, the demo and benchmarks. Each builds with
mlx-lm's own classes in well under a second.

Dims are multiples of 64 so 4-bit quantization with group size 64 applies
everywhere. ``UNTESTED`` lists the MoE families left out, and why.
"""

from typing import Dict

# Small configs, one per family; dims are multiples of 64 so 4-bit
# quantization with group size 64 applies everywhere.
_BASE = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, max_position_embeddings=1024)

CORE_FAMILIES: Dict[str, dict] = {
    "qwen3_moe": dict(
        _BASE, model_type="qwen3_moe", intermediate_size=256, num_experts=16,
        num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=64, head_dim=32, norm_topk_prob=True,
    ),
    "mixtral": dict(
        _BASE, model_type="mixtral", intermediate_size=64, num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "deepseek_v3": dict(
        _BASE, model_type="deepseek_v3", intermediate_size=256,
        moe_intermediate_size=64, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=64,
        q_lora_rank=64, qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32,
        n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        num_hidden_layers=4,
    ),
    "gpt_oss": dict(
        _BASE, model_type="gpt_oss", intermediate_size=64, num_local_experts=8,
        num_experts_per_tok=2, head_dim=32, sliding_window=16,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "qwen3_next": dict(
        _BASE, model_type="qwen3_next", intermediate_size=256,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=16,
        num_experts_per_tok=4, decoder_sparse_step=1,
        shared_expert_intermediate_size=64, mlp_only_layers=[],
        moe_intermediate_size=64, partial_rotary_factor=0.5, head_dim=32,
        full_attention_interval=2, num_hidden_layers=4,
    ),
    "kimi_k3": dict(
        model_type="kimi_k3", vocab_size=512, hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
        rms_norm_eps=1e-5, max_position_embeddings=1024,
        linear_attn_config=dict(num_heads=4, head_dim=32, short_conv_kernel_size=4,
                                kda_layers=[1, 3]),
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
        v_head_dim=32, num_experts=16, num_experts_per_token=4,
        num_shared_experts=1, moe_intermediate_size=64, first_k_dense_replace=1,
        num_expert_group=4, topk_group=2, routed_scaling_factor=2.0,
        activation_situ_beta=2.0,
    ),
    "olmoe": dict(
        _BASE, model_type="olmoe", intermediate_size=64, num_experts=16,
        num_experts_per_tok=4, head_dim=32,
    ),
    "qwen2_moe": dict(
        _BASE, model_type="qwen2_moe", intermediate_size=256, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    ),
    "glm4_moe": dict(
        _BASE, model_type="glm4_moe", intermediate_size=256, moe_intermediate_size=64,
        norm_topk_prob=True, n_group=1, head_dim=32, topk_group=1,
        n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=1.0,
        num_experts_per_tok=4, first_k_dense_replace=1, rope_scaling=None,
        use_qk_norm=True, attention_bias=False, partial_rotary_factor=0.5,
        num_hidden_layers=4,
    ),
}

# The DeepSeek-V3 text model that VL wrappers (kimi_vl, kimi_k25) nest.
_DSV3_TEXT = dict(
    _BASE, vocab_size=512, intermediate_size=256, moe_intermediate_size=64,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
    routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64,
    qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, n_group=4,
    topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
    num_hidden_layers=4,
)

# Text models that multimodal wrappers nest, and which are families too.
_MISTRAL4_TEXT = dict(
    _BASE, model_type="mistral4", vocab_size=512, intermediate_size=256,
    moe_intermediate_size=64, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=16, routed_scaling_factor=1.0, kv_lora_rank=64,
    q_lora_rank=64, norm_topk_prob=True, topk_group=1, num_experts_per_tok=4,
    first_k_dense_replace=1, n_group=1, qk_rope_head_dim=32,
    qk_nope_head_dim=32, v_head_dim=32, num_hidden_layers=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                         llama_4_scaling_beta=0.1,
                         original_max_position_embeddings=1024),
)
_QWEN35_TEXT = dict(
    _BASE, model_type="qwen3_5_moe_text", vocab_size=512, intermediate_size=256,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, head_dim=64,
    full_attention_interval=2, num_experts=16, num_experts_per_tok=4,
    decoder_sparse_step=1, shared_expert_intermediate_size=64,
    moe_intermediate_size=64, norm_topk_prob=True, num_hidden_layers=4,
    rope_parameters=dict(type="default", mrope_section=[3, 3, 2],
                         rope_theta=10000.0, partial_rotary_factor=0.25),
)
_GEMMA4_TEXT = dict(
    model_type="gemma4_text", hidden_size=128, num_hidden_layers=4,
    intermediate_size=256, num_attention_heads=4, head_dim=32,
    global_head_dim=64, global_partial_rotary_factor=0.25, rms_norm_eps=1e-6,
    vocab_size=512, vocab_size_per_layer_input=512, num_key_value_heads=2,
    num_global_key_value_heads=1, num_kv_shared_layers=0,
    hidden_size_per_layer_input=0, sliding_window=16, sliding_window_pattern=2,
    max_position_embeddings=1024, attention_k_eq_v=True,
    final_logit_softcapping=30.0, use_double_wide_mlp=False,
    enable_moe_block=True, num_experts=16, top_k_experts=4,
    moe_intermediate_size=64, tie_word_embeddings=True,
)

MORE_FAMILIES: Dict[str, dict] = {
    "mistral4": dict(_MISTRAL4_TEXT),
    "mistral3": dict(
        model_type="mistral3", text_config=dict(_MISTRAL4_TEXT),
    ),
    "nemotron_h": dict(
        model_type="nemotron_h", vocab_size=512, hidden_size=128,
        intermediate_size=256, max_position_embeddings=1024,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        attention_bias=False, mamba_num_heads=4, mamba_head_dim=32,
        mamba_proj_bias=False, ssm_state_size=64, conv_kernel=4, n_groups=1,
        mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
        use_conv_bias=True, hybrid_override_pattern=["M", "E", "*", "E"],
        moe_intermediate_size=64, moe_shared_expert_intermediate_size=128,
        n_group=1, n_routed_experts=16, n_shared_experts=1, topk_group=1,
        num_experts_per_tok=4, norm_topk_prob=True, routed_scaling_factor=2.5,
        tie_word_embeddings=False,
    ),
    "phimoe": dict(
        _BASE, model_type="phimoe", intermediate_size=64,
        original_max_position_embeddings=1024, rope_scaling=None,
        num_local_experts=16, num_experts_per_tok=2,
    ),
    "phixtral": dict(
        model_type="phixtral", num_vocab=512, model_dim=128, num_heads=4,
        num_layers=2, rotary_dim=16, num_experts_per_tok=2, num_local_experts=8,
    ),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(_QWEN35_TEXT)),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(_QWEN35_TEXT)),
    "qwen3_vl_moe": dict(
        model_type="qwen3_vl_moe",
        text_config=dict(
            _BASE, model_type="qwen3_vl_moe_text", vocab_size=512,
            intermediate_size=256, num_experts=16, num_experts_per_tok=4,
            decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=64,
            head_dim=32, norm_topk_prob=True,
        ),
    ),
    "solar_open": dict(
        _BASE, model_type="solar_open", intermediate_size=256,
        moe_intermediate_size=64, norm_topk_prob=True, n_group=1, head_dim=32,
        topk_group=1, n_shared_experts=1, n_routed_experts=16,
        routed_scaling_factor=1.0, num_experts_per_tok=4,
        first_k_dense_replace=1, rope_scaling=None, use_qk_norm=False,
        attention_bias=False, partial_rotary_factor=1.0, num_hidden_layers=4,
    ),
    "step3p5": dict(
        model_type="step3p5", hidden_size=128, num_hidden_layers=4,
        vocab_size=512, num_attention_heads=4, num_attention_groups=2,
        head_dim=32, intermediate_size=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=1024, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        partial_rotary_factors=[1.0, 0.5, 1.0, 0.5],
        attention_other_setting=dict(num_attention_heads=4, num_attention_groups=4),
        use_head_wise_attn_gate=True, moe_num_experts=16, moe_top_k=4,
        moe_intermediate_size=64, share_expert_dim=64, moe_layers_enum="1,2,3",
        moe_router_scaling_factor=3.0, norm_expert_weight=True,
        swiglu_limits=[0.0, 7.0, 7.0, 7.0], swiglu_limits_shared=[0.0, 0.0, 0.0, 16.0],
        tie_word_embeddings=False,
    ),
    "gemma4_text": dict(_GEMMA4_TEXT),
    "gemma4": dict(model_type="gemma4", vocab_size=512, text_config=dict(_GEMMA4_TEXT)),
    "longcat_flash": dict(
        model_type="longcat_flash", attention_method="MLA",
        zero_expert_type="identity", hidden_size=128, ffn_hidden_size=256,
        moe_topk=4, expert_ffn_hidden_size=64, n_routed_experts=16,
        zero_expert_num=4, num_layers=2, vocab_size=512,
        max_position_embeddings=1024, num_attention_heads=4, kv_lora_rank=64,
        q_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        routed_scaling_factor=6.0, rms_norm_eps=1e-5, rope_theta=10000.0,
        mla_scale_q_lora=True, mla_scale_kv_lora=True, attention_bias=False,
        norm_topk_prob=False, router_bias=False,
    ),
    "mellum": dict(
        _BASE, model_type="mellum", intermediate_size=256, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=64, head_dim=32,
        norm_topk_prob=True, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=dict(
            full_attention=dict(rope_theta=10000.0, rope_type="default"),
            sliding_attention=dict(rope_theta=10000.0, rope_type="default"),
        ),
        num_hidden_layers=4,
    ),
    "mimo_v2_flash": dict(
        _BASE, model_type="mimo_v2_flash", num_experts_per_tok=4,
        hybrid_layer_pattern=[0, 1, 1, 0], moe_layer_freq=[0, 1, 1, 1],
        add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        sliding_window_size=16, intermediate_size=256, moe_intermediate_size=64,
        n_shared_experts=None, n_routed_experts=16, routed_scaling_factor=None,
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        n_group=1, topk_group=1, layernorm_epsilon=1e-5, swa_rope_theta=10000.0,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, head_dim=32,
        v_head_dim=32, swa_head_dim=32, swa_v_head_dim=32,
        partial_rotary_factor=0.5, attention_value_scale=0.707,
        num_hidden_layers=4,
    ),
    "minimax": dict(
        _BASE, model_type="minimax", intermediate_size=64, num_local_experts=16,
        num_experts_per_tok=4, shared_intermediate_size=0, rotary_dim=16,
        head_dim=32, use_qk_norm=True,
    ),
    "minimax_m3_vl": dict(
        model_type="minimax_m3_vl",
        text_config=dict(
            model_type="minimax_m3", vocab_size=512, hidden_size=128,
            intermediate_size=64, dense_intermediate_size=256,
            shared_intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=4, num_local_experts=16,
            num_experts_per_tok=4, max_position_embeddings=1024,
            rms_norm_eps=1e-5, rope_theta=10000.0, head_dim=32,
            partial_rotary_factor=0.5, tie_word_embeddings=False,
            routed_scaling_factor=2.0, use_qk_norm=True, use_gemma_norm=True,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            layer_types=["full_attention", "minimax_m3_sparse",
                         "minimax_m3_sparse", "full_attention"],
            index_n_heads=4, index_head_dim=64, index_block_size=8,
            index_topk_blocks=2, index_local_blocks=1,
        ),
    ),
    "kimi_linear": dict(
        model_type="kimi_linear", vocab_size=512, hidden_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=256, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
        linear_attn_config=dict(num_heads=2, head_dim=64, short_conv_kernel_size=4,
                                kda_layers=[1, 3]),
        model_max_length=1024, num_experts=16, moe_intermediate_size=64,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        mla_use_nope=True, num_experts_per_token=4, num_shared_experts=1,
        routed_scaling_factor=2.0, first_k_dense_replace=1, num_expert_group=4,
        topk_group=2, max_position_embeddings=1024,
    ),
    "kimi_k25": dict(
        model_type="kimi_k25",
        text_config=dict(_DSV3_TEXT, model_type="kimi_k2"),
    ),
    "kimi_vl": dict(
        model_type="kimi_vl",
        text_config=dict(_DSV3_TEXT, model_type="deepseek_v3"),
    ),
    "laguna": dict(
        _BASE, model_type="laguna", intermediate_size=256, head_dim=32,
        gating=True, sliding_window=16, partial_rotary_factor=0.5,
        rope_parameters=dict(
            full_attention=dict(rope_theta=10000.0, partial_rotary_factor=0.5),
            sliding_attention=dict(rope_theta=10000.0, partial_rotary_factor=1.0),
        ),
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_attention_heads_per_layer=[4, 4, 4, 4],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5,
        moe_router_score_func="sigmoid", num_hidden_layers=4,
    ),
    "lfm2_moe": dict(
        _BASE, model_type="lfm2_moe", intermediate_size=256,
        moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_hidden_layers=4,
    ),
    "llama4": dict(
        model_type="llama4",
        text_config=dict(
            model_type="llama4_text", vocab_size=512, hidden_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=64, intermediate_size_mlp=256,
            interleave_moe_layer_step=1, attention_bias=False,
            attention_chunk_size=16, max_position_embeddings=1024,
            num_experts_per_tok=1, num_local_experts=16, rms_norm_eps=1e-5,
            rope_scaling=None, rope_theta=10000.0, use_qk_norm=True,
            attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
        ),
    ),
    "glm4_moe_lite": dict(
        _BASE, model_type="glm4_moe_lite", intermediate_size=256,
        moe_intermediate_size=64, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=16, routed_scaling_factor=1.8, kv_lora_rank=64,
        q_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        num_nextn_predict_layers=0, num_hidden_layers=4,
    ),
    "glm_moe_dsa": dict(
        _BASE, model_type="glm_moe_dsa", intermediate_size=256,
        moe_intermediate_size=64, num_key_value_heads=4, index_head_dim=64,
        index_n_heads=4, index_topk=8, n_shared_experts=1, n_routed_experts=16,
        routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64,
        qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32,
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        n_group=4, topk_group=2, num_experts_per_tok=4, moe_layer_freq=1,
        first_k_dense_replace=1, attention_bias=False,
        rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
        num_hidden_layers=4,
    ),
    "granitemoe": dict(
        _BASE, model_type="granitemoe", intermediate_size=64, logits_scaling=4.0,
        attention_multiplier=0.03125, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_bias=False, num_local_experts=16,
        num_experts_per_tok=4,
    ),
    "granitemoehybrid": dict(
        _BASE, model_type="granitemoehybrid", intermediate_size=64,
        attention_bias=False, embedding_multiplier=12.0,
        attention_multiplier=0.03125, logits_scaling=4.0,
        residual_multiplier=0.22, num_local_experts=16, num_experts_per_tok=4,
        shared_intermediate_size=128, mamba_n_heads=4, mamba_d_head=64,
        mamba_proj_bias=False, mamba_d_state=64, mamba_d_conv=4,
        mamba_n_groups=1, mamba_conv_bias=True, position_embedding_type="rope",
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_hidden_layers=4,
    ),
    "hunyuan": dict(
        _BASE, model_type="hunyuan", intermediate_size=64, attention_bias=False,
        moe_topk=4, num_experts=16, num_shared_expert=1, use_mixed_mlp_moe=True,
        use_qk_norm=True, use_cla=False, cla_share_factor=2,
        moe_intermediate_size=64,
        rope_scaling=dict(alpha=1.0, factor=1.0, type="dynamic"),
    ),
    "jamba": dict(
        _BASE, model_type="jamba", intermediate_size=64, attn_layer_offset=1,
        attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
        mamba_d_conv=4, mamba_d_state=16, mamba_expand=2, mamba_dt_rank=64,
        num_experts=16, num_experts_per_tok=4, num_hidden_layers=4,
    ),
    "deepseek": dict(
        _BASE, model_type="deepseek", intermediate_size=256,
        moe_intermediate_size=64, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1,
        num_hidden_layers=4,
    ),
    # DeepSeek-V3's tiny config with V2's router and a rope_scaling dict,
    # which V2's code reads unconditionally.
    "deepseek_v2": dict(
        CORE_FAMILIES["deepseek_v3"], model_type="deepseek_v2", routed_scaling_factor=1.0,
        topk_method="group_limited_greedy",
        rope_scaling=dict(type="yarn", factor=1.0, original_max_position_embeddings=1024,
                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0),
    ),
    "deepseek_v32": dict(
        _BASE, model_type="deepseek_v32", intermediate_size=256,
        moe_intermediate_size=64, num_key_value_heads=4, index_head_dim=64,
        index_n_heads=4, index_topk=8, n_shared_experts=1, n_routed_experts=16,
        routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64,
        qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        num_hidden_layers=4,
    ),
    "dots1": dict(
        _BASE, model_type="dots1", intermediate_size=256, first_k_dense_replace=1,
        moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
        norm_topk_prob=True, num_experts_per_tok=4, routed_scaling_factor=2.5,
        head_dim=32, scoring_func="noaux_tc", n_group=4, topk_group=2,
        num_hidden_layers=4,
    ),
    "ernie4_5_moe": dict(
        _BASE, model_type="ernie4_5_moe", intermediate_size=256, use_bias=False,
        moe_num_experts=16, moe_layer_start_index=1, moe_intermediate_size=64,
        moe_k=4, moe_layer_interval=1, moe_use_aux_free=True,
        moe_num_shared_experts=1, head_dim=32, num_hidden_layers=4,
    ),
    "exaone_moe": dict(
        _BASE, model_type="exaone_moe", intermediate_size=256,
        moe_intermediate_size=64, head_dim=32, num_experts=16,
        num_experts_per_tok=4, num_shared_experts=1, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                     "full_attention"],
        is_moe_layer=[False, True, True, True], n_group=4, topk_group=2,
        num_hidden_layers=4,
    ),
    "Klear": dict(
        _BASE, model_type="Klear", intermediate_size=256, attention_bias=False,
        mlp_only_layers=[0], num_experts=16, num_experts_per_tok=4,
        decoder_sparse_step=1, n_shared_experts=1, moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    "afmoe": dict(
        _BASE, model_type="afmoe", intermediate_size=256, moe_intermediate_size=64,
        head_dim=32, num_experts=16, num_experts_per_tok=4, num_shared_experts=1,
        num_dense_layers=1, n_group=4, topk_group=2, sliding_window=16,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "bailing_moe": dict(
        _BASE, model_type="bailing_moe", intermediate_size=256,
        moe_intermediate_size=64, num_experts=16, num_shared_experts=1,
        norm_topk_prob=True, num_experts_per_tok=4, first_k_dense_replace=1,
        use_qk_norm=True, moe_router_enable_expert_bias=True,
        score_function="sigmoid", n_group=4, topk_group=2, num_hidden_layers=4,
    ),
    "bailing_moe_linear": dict(
        _BASE, model_type="bailing_moe_linear", intermediate_size=256,
        moe_intermediate_size=64, num_experts=16, num_shared_experts=1,
        norm_topk_prob=True, num_experts_per_tok=4, first_k_dense_replace=1,
        layer_group_size=2, group_norm_size=4, head_dim=32, use_qk_norm=True,
        partial_rotary_factor=0.5, moe_router_enable_expert_bias=True,
        score_function="sigmoid", n_group=4, topk_group=2, num_hidden_layers=4,
    ),
    "bailing_hybrid": dict(
        _BASE, model_type="bailing_hybrid", intermediate_size=256,
        moe_intermediate_size=64, num_key_value_heads=4, num_experts=16,
        num_experts_per_tok=4, num_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1, layer_group_size=2, group_norm_size=4,
        routed_scaling_factor=2.5, head_dim=32, kv_lora_rank=64,
        q_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        num_hidden_layers=4,
    ),
    "bailing_moe_v3": dict(
        _BASE, model_type="bailing_hybrid",
        architectures=["BailingMoeV3ForCausalLM"], intermediate_size=256,
        moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
        num_key_value_heads=4, num_experts=16, num_experts_per_tok=4,
        num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, layer_group_size=2, head_dim=32,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, short_conv_kernel_size=4,
        num_hidden_layers=4,
    ),
}

# LongCat-Flash with n-gram embeddings.
MORE_FAMILIES["longcat_flash_ngram"] = dict(
    MORE_FAMILIES["longcat_flash"], model_type="longcat_flash_ngram", ngram_vocab_size_ratio=4,
    emb_neighbor_num=2, emb_split_num=2,
)

# Extra variants of families above, for code paths their main config skips.
VARIANTS: Dict[str, dict] = {
    # Latent MoE (Nemotron 3 Super): experts see a projected 64-wide input.
    "nemotron_h_latent": dict(MORE_FAMILIES["nemotron_h"], moe_latent_size=64),
    # Cross-layer attention: odd layers reuse the previous layer's K/V.
    "hunyuan_cla": dict(MORE_FAMILIES["hunyuan"], use_cla=True, cla_share_factor=2),
}

FAMILIES: Dict[str, dict] = {**CORE_FAMILIES, **MORE_FAMILIES, **VARIANTS}

UNTESTED = {
    "deepseek_v41": "mlx-lm's own model is not deterministic here: three prefills of one "
                    "prompt with fresh caches give different logits (8+ tokens), so "
                    "bit-exact parity cannot be checked",
    "muse_spark": "its attention, norms and routing are Metal kernels with no CPU path",
    "prism_hadamard_qwen35": "a pre-packed 2-bit Hadamard format that no tiny model "
                             "can be quantized into",
    "dbrx": "its experts are lists of Linear layers, not SwitchGLU/SwitchMLP",
}
