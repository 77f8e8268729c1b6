"""Weights and checkpoints in and out of the learner: Hugging Face weights into live models and
distributed checkpoints (checkpoint, with asynchronous saves in async_save and the writer's helper
processes in child_procs), the export stream of every weight sync (export), and the conversion
workflows behind `tools/convert_checkpoint.py` (conversion; `convert lora-to-peft` in
lora_to_peft)."""
