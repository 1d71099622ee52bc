from minioverlap.cli import main

main()
