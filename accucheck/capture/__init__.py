"""Capture: run a model on prompts with hooks and write one HDF5 capture file (accucheck.store).

- options.py: `CaptureOptions` and `check_runner`, every flag clash checked once (exit 2).
- models.py: loading a Hugging Face directory, tokenising, the greedy / teacher-forced run.
- device.py: cpu / cuda / npu, seeds, determinism, the environment fingerprint.
- record/: what a hook does with a tensor: the recorder, op-level records, shadow replay,
  producer links, module selection, statistics (and their C kernel), graph-mode taps, compile
  progress, MoE routing, tensor-parallel rank copies. record/ never imports the runners
  (tests/test_layout.py).
- runners/: who drives the model and feeds the file: hf (transformers, eager or
  torch.compile), vllm (the engine; vllm_plugin is its worker side, vllm_facts / vllm_moe what
  the workers report and where vLLM routes), batched (HF rows padded into one batch, for the
  configuration matrix), control (a control run of a reference capture).
- tiny.py, emulate.py, faults.py: the built-in tiny models, emulated devices and planted faults
  (tests, `accucheck demo`, bench/).
"""
