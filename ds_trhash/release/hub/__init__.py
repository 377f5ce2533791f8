"""The run's copy on the Hugging Face Hub: what a sync uploads and how it is compared with the Hub
(``units``), the lock and verified record it keeps (``lock``), the client every call goes through
(``client``), the upload loop (``sync``) and ``sync --watch`` beside a training run (``watch``).
Nothing here imports torch: every pass of a watcher is a new process."""
