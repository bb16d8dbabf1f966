"""Imported once, by multiprocessing's fork server only (the first module of its preload list in
:mod:`.launch`): the fork server dies with the launcher that started it (:func:`.signals.die_with_parent`)
and ignores SIGTERM (a ``kill`` or ``scancel`` aimed at the whole job is for the launcher and the
workers, which stop at a step boundary; the fork server lives exactly as long as its launcher).
Never import it elsewhere: it changes the importing process.
"""

import signal

from .signals import die_with_parent

die_with_parent()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
