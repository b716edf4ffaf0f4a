from rsi.cli import main

main()
