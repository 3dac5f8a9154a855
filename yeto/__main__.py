from yeto.cli import main

main()
