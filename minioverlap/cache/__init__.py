# >>> ch02 file: the paged KV cache
