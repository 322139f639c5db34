"""Helpers for the course "Gemma 4 E4B on small GPUs": one module per concept it teaches. The lab's equipment
(benchmark, measure runner, record writers, load test) is the ``lab`` package, which imports this one.

Imports point down this list, never up:

    links                          the course's addresses: repository, Colab links, troubleshooting entries
    errors, paths, noise           the exception family; where files live; expected messages, silenced
    course                         set-up without make (setup, test, lab; a CUDA torch), Colab's install cell, the Drive cache
    cards, host_memory, checksums  the learners' cards (and simulating one); host RAM; sha256 and git blob ids of files
    synthetic, download            random-weight checkpoints of the real shapes; downloading with retries, verified
    models                         where a checkpoint comes from: hub id, folder or synthetic name; its config
    placement, quantization        device maps and the PLE offload; bitsandbytes configs
    weights                        bytes per part from the meta model, before loading
    loading                        load_model(source, quant, ple, device)
    fine_tuning                    LoRA adapters on the text decoder, QLoRA's set-up, a task to learn, the training loop
    exact_norm                     one kernel per RMSNorm in the decode step, summing as ATen's CUDA mean does
    exact_rotary                   one kernel per rotary embedding in the decode step, rounding as ATen's bf16 ops do
    exact_layer                    one kernel per block end of a decoder layer: norm, residual add, scalar, next norm
    exact_nf4                      one kernel per NF4 projection (or q, k, v joined), summing as bitsandbytes does
    exact_cache                    one kernel per cache layer's write of a decode token and its counter
    long_context, decoding         long prompts without copies (chunks, window-sized cache); greedy decoding in CUDA graphs
    measure                        greedy runs and their logits compared: bit for bit, within rounding, with a control
    records                        readers of the recorded results (data/measurements, gpu-tier, gguf, chat, cited)
    planner                        predict / fits: memory before loading, from a config and the records
    anatomy, charts, environment   module trees, plots, the setup check
    mirror, faults                 a classroom mirror (files streamed from disk, olah behind a guarding front); a fault-injecting proxy
    chat, gguf_route               chatting through the chat template with streaming and a stop button; the llama.cpp route
    exercises                      the exercises that end each notebook and the checker of each answer
"""

__version__ = "0.1.0"
