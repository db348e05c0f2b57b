"""Loading weights: a checkpoint described once (`formats.Checkpoint`: Hugging Face safetensors, a mapped
checkpoint, Orbax, or a module in memory), the abstract model it fills (`abstract.py`), its reader composed
for that model and every parameter placed on the mesh by the partition rules (`load.py` is the path);
`convert.py` writes the converted formats."""
