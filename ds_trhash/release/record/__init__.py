"""The publishable run record: the run folder's files it reads (``run_files``) and the record built
from them (``writer``), which never guesses a value nobody can vouch for."""
