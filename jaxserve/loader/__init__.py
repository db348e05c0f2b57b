"""Loading weights: detect a checkpoint's format, read it (Hugging Face safetensors, a mapped checkpoint,
Orbax), place every parameter on the mesh by the partition rules (`load.py` is the path); `convert.py`
writes the converted formats."""
