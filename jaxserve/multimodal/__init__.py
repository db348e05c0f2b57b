"""Images in requests, on the host (PIL and numpy, no JAX): loading them from URLs with the guards a server
needs (`media.py`), and preprocessing them as each checkpoint's processor does, with the prompt's image
placeholders expanded to match (`processors.py`, on the pixel steps of `image_ops.py`). The encoders that
turn the processed pixels into embeddings are models: `jaxserve/model/siglip.py`, `qwen_vit.py`."""
