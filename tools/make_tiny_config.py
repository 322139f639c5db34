"""Derive data/configs/tiny.config.json from the E4B config: every structural feature, tiny sizes.

Kept: PLE, KV sharing over both attention types (the last sliding and the last full layer
share), sliding and full layers with a different head width, vision and audio towers, tied
embeddings, E4B's rope and softcapping settings. Sizes are multiples of 32 with input widths
of at least 64, because bitsandbytes' 4-bit CPU kernel needs both.

    python tools/make_tiny_config.py
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers.paths import CONFIG_DIR  # noqa: E402

e4b = json.loads((CONFIG_DIR / "gemma-4-E4B-it.config.json").read_text())
t = json.loads(json.dumps(e4b))
t.pop("transformers_version", None)
# token ids: every special token inside a 320-entry vocab; the turn markers at Gemma 4's published ids
# (helpers.synthetic.PROTOCOL_TOKENS), so that tiny stops where the real model does
ids = dict(pad=0, eos=1, bos=2, unk=3, sot=105, eot=106, boi=6, boa=7, image=8, audio=9, eoi=10, eoa=11, video=12)
t.update(image_token_id=ids["image"], boi_token_id=ids["boi"], eoi_token_id=ids["eoi"], audio_token_id=ids["audio"],
         boa_token_id=ids["boa"], eoa_token_id=ids["eoa"], eoa_token_index=ids["eoa"], video_token_id=ids["video"],
         eos_token_id=[ids["eos"], ids["eot"]], vision_soft_tokens_per_image=70)
tc = t["text_config"]
tc.update(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
          head_dim=32, global_head_dim=64, hidden_size_per_layer_input=64, num_kv_shared_layers=2,
          sliding_window=8, vocab_size=320, vocab_size_per_layer_input=320, max_position_embeddings=4096,
          # as in E4B and E2B, the last layer before the KV-shared ones is full attention and the one
          # before it sliding: llama.cpp's Gemma 4 KV reuse assumes this order (llama-model.cpp) and
          # aborts on any other (GGML_ASSERT in llama-kv-cache.cpp)
          layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                       "full_attention", "sliding_attention", "full_attention"])
vc = t["vision_config"]
vc.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
          head_dim=32, global_head_dim=32, position_embedding_size=256, default_output_length=70)
ac = t["audio_config"]
# the first conv as wide as the 128 mel bins, as in E4B: transformers sizes the audio input projection as
# channels[0] // 4 * channels[1], which matches what the convs give real features only then
ac.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, output_proj_dims=64, subsampling_conv_channels=[128, 4])
(CONFIG_DIR / "tiny.config.json").write_text(json.dumps(t, indent=2) + "\n")
