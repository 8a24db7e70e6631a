from polyrl.cli import app

app()
