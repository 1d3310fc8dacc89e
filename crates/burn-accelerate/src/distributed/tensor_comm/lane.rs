//! Where the host implementation's engine calls run: on the caller's thread, completing when they are started, or
//! on a communication thread of their own, over a copy of the group's communicator (`split` with one color), so
//! that a started call runs while the caller computes. Calls on one lane keep the order they were started in, on
//! every rank; the copy keeps them apart from the calls the rank's own thread makes on the group's communicator
//! (object collectives, debug mode's checks), whose order is their own.

use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use super::Pending;
use crate::distributed::comm::{CommResult, Communicator};
use crate::error::{Error, Result};

/// One engine call, run with the lane's communicator.
type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// Where calls run.
pub(crate) enum Lane {
    /// On the caller's thread, through this communicator.
    Inline(Arc<dyn Communicator>),
    /// On a thread of its own.
    Thread(Worker),
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lane::Inline(_) => f.write_str("Lane::Inline"),
            Lane::Thread(_) => f.write_str("Lane::Thread"),
        }
    }
}

impl Lane {
    /// A communication thread over a copy of `comm` (a collective: every rank of `comm` makes it), where the
    /// engine lets a copy run beside the original ([`Communicator::concurrent`]); else the caller's thread.
    ///
    /// # Errors
    /// The copy's `split` failed; the thread could not be started.
    pub fn threaded(comm: &Arc<dyn Communicator>) -> Result<Self> {
        if !comm.concurrent() {
            return Ok(Lane::Inline(comm.clone()));
        }
        let copy = comm.split(0, comm.rank())?;
        Ok(Lane::Thread(Worker::start(copy)?))
    }

    /// Starts `call`: runs it now on an inline lane, or hands it to the lane's thread.
    ///
    /// # Errors
    /// The inline call's own error; a communication thread that has ended.
    pub fn start<T: Send + 'static>(
        &self,
        call: impl FnOnce(&dyn Communicator) -> CommResult<T> + Send + 'static,
    ) -> Result<Pending<T>> {
        match self {
            Lane::Inline(comm) => Ok(Pending::ready(call(comm.as_ref())?)),
            Lane::Thread(worker) => worker.submit(call),
        }
    }
}

/// A communication thread: runs the jobs it is handed, in order, with its own communicator.
pub(crate) struct Worker {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    fn start(comm: Arc<dyn Communicator>) -> Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("burn-accelerate-comm-{}", comm.rank()))
            .spawn(move || {
                for job in queue {
                    job(comm.as_ref());
                }
            })
            .map_err(|e| Error::other(format!("starting a communication thread: {e}")))?;
        Ok(Self {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    fn submit<T: Send + 'static>(
        &self,
        call: impl FnOnce(&dyn Communicator) -> CommResult<T> + Send + 'static,
    ) -> Result<Pending<T>> {
        let (done, result) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |comm| {
            let _ = done.send(call(comm));
        });
        let ended = || Error::other("the communication thread ended before the call completed");
        self.jobs
            .as_ref()
            .ok_or_else(ended)?
            .send(job)
            .map_err(|_| ended())?;
        Ok(Pending::later(move || match result.recv() {
            Ok(outcome) => Ok(outcome?),
            Err(_) => Err(ended()),
        }))
    }
}

impl Drop for Worker {
    /// The thread finishes the calls it was handed (each ends by its own timeout at the latest) and ends with
    /// the communicator it holds.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
