"""LoRA adapters on one base model: reading PEFT adapters (`adapter.py`), their device slot stacks
(`slots.py`), the term the model's projections add (`delta.py`) and which adapter holds which slot
(`manager.py`)."""
