//! `burn-accelerate config`: Accelerate's questionnaire. Arrow-key menus in a terminal; plain numbered prompts
//! when the input is not a terminal (a pipe, a script), so both can answer it.

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;

use crate::config_file::{self, ConfigAnswers};
use burn_accelerate::MixedPrecision;

/// Asks the questions, one way or the other.
trait Ask {
    /// One of `options` (index); `default` is taken on an empty answer.
    fn select(
        &mut self,
        question: &str,
        options: &[&str],
        default: usize,
    ) -> std::io::Result<usize>;
    /// A number; `default` on an empty answer.
    fn number(&mut self, question: &str, default: usize) -> std::io::Result<usize>;
    /// A line of text; `default` on an empty answer.
    fn text(&mut self, question: &str, default: &str) -> std::io::Result<String>;
}

/// Arrow-key menus (dialoguer).
struct Menus;

impl Ask for Menus {
    fn select(
        &mut self,
        question: &str,
        options: &[&str],
        default: usize,
    ) -> std::io::Result<usize> {
        dialoguer::Select::new()
            .with_prompt(question)
            .items(options)
            .default(default)
            .interact()
            .map_err(std::io::Error::other)
    }
    fn number(&mut self, question: &str, default: usize) -> std::io::Result<usize> {
        dialoguer::Input::new()
            .with_prompt(question)
            .default(default)
            .interact_text()
            .map_err(std::io::Error::other)
    }
    fn text(&mut self, question: &str, default: &str) -> std::io::Result<String> {
        dialoguer::Input::new()
            .with_prompt(question)
            .default(default.to_string())
            .interact_text()
            .map_err(std::io::Error::other)
    }
}

/// Numbered prompts on plain lines.
struct Lines<R: BufRead> {
    input: R,
}

impl<R: BufRead> Lines<R> {
    fn line(&mut self, prompt: &str) -> std::io::Result<String> {
        print!("{prompt} ");
        std::io::stdout().flush()?;
        let mut line = String::new();
        if self.input.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the input ended before every question was answered",
            ));
        }
        Ok(line.trim().to_string())
    }
}

impl<R: BufRead> Ask for Lines<R> {
    fn select(
        &mut self,
        question: &str,
        options: &[&str],
        default: usize,
    ) -> std::io::Result<usize> {
        println!("{question}");
        for (i, option) in options.iter().enumerate() {
            println!("  [{i}] {option}");
        }
        loop {
            let answer = self.line(&format!(
                "Please select a choice using its number [{default}]:"
            ))?;
            if answer.is_empty() {
                return Ok(default);
            }
            let by_name = options.iter().position(|o| o.eq_ignore_ascii_case(&answer));
            match answer
                .parse::<usize>()
                .ok()
                .filter(|i| *i < options.len())
                .or(by_name)
            {
                Some(i) => return Ok(i),
                None => println!("Please enter a number from 0 to {}.", options.len() - 1),
            }
        }
    }
    fn number(&mut self, question: &str, default: usize) -> std::io::Result<usize> {
        loop {
            let answer = self.line(&format!("{question} [{default}]:"))?;
            if answer.is_empty() {
                return Ok(default);
            }
            match answer.parse() {
                Ok(n) => return Ok(n),
                Err(_) => println!("Please enter a whole number."),
            }
        }
    }
    fn text(&mut self, question: &str, default: &str) -> std::io::Result<String> {
        let answer = self.line(&format!("{question} [{default}]:"))?;
        Ok(if answer.is_empty() {
            default.to_string()
        } else {
            answer
        })
    }
}

const YES_NO: &[&str] = &["no", "yes"];

/// Accelerate's questions, for what this crate runs.
fn ask(asker: &mut dyn Ask) -> std::io::Result<ConfigAnswers> {
    let kinds = ["No distributed training", "multi-CPU", "multi-GPU"];
    let kind = asker.select("Which type of machine are you using?", &kinds, 0)?;
    let mut answers = ConfigAnswers {
        distributed_type: ["NO", "MULTI_CPU", "MULTI_GPU"][kind].into(),
        ..ConfigAnswers::default()
    };
    if kind > 0 {
        answers.num_machines = asker.number(
            "How many different machines will you use (use more than 1 for multi-node training)?",
            1,
        )?;
        if answers.num_machines > 1 {
            answers.machine_rank = asker.number("What is the rank of this machine?", 0)?;
            answers.main_process_ip = Some(asker.text(
                "What is the IP address of the machine that will host the main process?",
                "127.0.0.1",
            )?);
            answers.main_process_port = Some(asker.number(
                "What is the port you will use to communicate with the main process?",
                29500,
            )? as u16);
        }
        answers.num_processes = asker.number(
            "How many processes should be used for distributed training?",
            2,
        )?;
    }
    answers.use_cpu = kind == 1
        || asker.select(
            "Do you want to run your training on CPU only (even if a GPU is available)?",
            YES_NO,
            0,
        )? == 1;
    answers.debug = kind > 0
        && asker.select(
            "Should distributed operations be checked while running for errors? This can avoid timeout issues but will be slower.",
            YES_NO,
            0,
        )? == 1;
    let precisions = ["no", "fp16", "bf16"];
    let precision = asker.select("Do you wish to use mixed precision?", &precisions, 0)?;
    answers.mixed_precision = precisions[precision].parse().unwrap_or(MixedPrecision::No);
    Ok(answers)
}

/// Runs the questionnaire and writes `path`.
pub fn run(path: &Path) -> burn_accelerate::Result<()> {
    let interactive = std::io::stdin().is_terminal() && std::io::stdout().is_terminal();
    let answers = if interactive {
        ask(&mut Menus)
    } else {
        ask(&mut Lines {
            input: std::io::stdin().lock(),
        })
    }
    .map_err(|e| burn_accelerate::Error::InvalidArgument(format!("config: {e}")))?;
    config_file::write_config(path, &answers, true)?;
    println!("burn-accelerate configuration saved at {}", path.display());
    Ok(())
}
