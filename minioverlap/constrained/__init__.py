# >>> ch19 file: grammar-constrained output
