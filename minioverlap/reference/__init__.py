"""The reference paths of chapters 01-03: generation before the scheduler existed. The live engine does
not use them; the early chapters, their tests and examples do, and later chapters compare against them."""
