# >>> ch04 file: the device layer
