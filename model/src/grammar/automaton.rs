//! The character-level pushdown automaton behind [`JsonState`]: one frame per open JSON value
//! (literal, choice, string, number, sequence, array, free-form value or object), each
//! consuming characters until it finishes or hands the character back to its parent.

use std::sync::Arc;

use super::{
    Node, SeqItem, ANY_MAX_MEMBERS, DEFAULT_MAX_STRING_CHARS, MAX_INTEGER_CHARS, MAX_NUMBER_CHARS,
};

#[derive(Debug, Clone, Copy, PartialEq)]
enum StrPhase {
    Open,
    In,
    Esc,
    Uni(u8),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum ContPhase {
    /// Expect the opening bracket.
    Open,
    /// After the opening bracket: a member or the close.
    First,
    /// A member value is being parsed (child frame on top).
    Member,
    /// After a member: `,` or the close.
    After,
    /// After `,`: expect the space.
    Space,
    /// After the space: a member.
    Next,
    /// Free-form object: key parsed, expect `: ` then the value.
    Colon,
    /// Free-form object: `: ` consumed, value next.
    Value,
}

#[derive(Debug, Clone)]
enum Frame {
    Lit(Arc<[char]>, usize),
    Choice(Arc<Vec<Vec<char>>>, String),
    Str {
        phase: StrPhase,
        len: usize,
        max: usize,
    },
    Num(String, bool),
    Seq(Arc<Vec<SeqItem>>, usize),
    Arr {
        item: Arc<Node>,
        count: usize,
        min: usize,
        max: usize,
        phase: ContPhase,
    },
    AnyVal(usize),
    AnyObj {
        depth: usize,
        count: usize,
        phase: ContPhase,
    },
}

enum Step {
    /// Consumed; the frame needs more.
    More,
    /// Consumed and the frame is finished.
    Done,
    /// Not consumed: the frame was already complete; pop it and offer the char to the parent.
    NotMine,
    /// Push this child and offer it the char.
    Push(Frame),
    /// Replace this frame by another and offer it the char.
    Become(Frame),
    Reject,
}

fn frame_for(node: &Node) -> Frame {
    match node {
        Node::Seq(items) => Frame::Seq(items.clone(), 0),
        Node::Choice(c) => Frame::Choice(c.clone(), String::new()),
        Node::Str(max) => Frame::Str {
            phase: StrPhase::Open,
            len: 0,
            max: *max,
        },
        Node::Num(int) => Frame::Num(String::new(), *int),
        Node::Arr(item, min, max) => Frame::Arr {
            item: item.clone(),
            count: 0,
            min: *min,
            max: *max,
            phase: ContPhase::Open,
        },
        Node::Any(d) => Frame::AnyVal(*d),
        Node::AnyObject(d) => Frame::AnyObj {
            depth: *d,
            count: 0,
            phase: ContPhase::Open,
        },
    }
}

/// Whether `s` is a prefix of a JSON number (`int` = integers only) and whether it is complete.
fn number_state(s: &str, int: bool) -> Option<bool> {
    let b = s.as_bytes();
    let mut i = 0;
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    if i == b.len() {
        return Some(false);
    }
    if b[i] == b'0' {
        i += 1;
    } else if b[i].is_ascii_digit() {
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
    } else {
        return None;
    }
    if i == b.len() {
        return Some(true);
    }
    if int {
        return None;
    }
    if b[i] == b'.' {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == b.len() {
            return Some(i > start);
        }
        if i == start {
            return None;
        }
    }
    if b[i] == b'e' || b[i] == b'E' {
        i += 1;
        if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
            i += 1;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        // Two exponent digits at most: every accepted number fits an f64.
        if i == b.len() && i - start <= 2 {
            return Some(i > start);
        }
    }
    None
}

impl Frame {
    /// Offers `c` to this frame: each kind of frame has its own step function below.
    fn step(&mut self, c: char) -> Step {
        match self {
            Frame::Lit(chars, pos) => step_lit(chars, pos, c),
            Frame::Choice(options, typed) => step_choice(options, typed, c),
            Frame::Str { phase, len, max } => step_str(phase, len, *max, c),
            Frame::Num(text, int) => step_num(text, *int, c),
            Frame::Seq(items, idx) => match items.get(*idx) {
                Some(SeqItem::Lit(l)) => Step::Push(Frame::Lit(l.clone(), 0)),
                Some(SeqItem::Value(n)) => Step::Push(frame_for(n)),
                None => Step::Reject,
            },
            Frame::Arr {
                item,
                count,
                min,
                max,
                phase,
            } => step_arr(item, *count, *min, *max, phase, c),
            Frame::AnyVal(depth) => step_any_val(*depth, c),
            Frame::AnyObj {
                depth,
                count,
                phase,
            } => step_any_obj(*depth, *count, phase, c),
        }
    }

    /// A child finished; returns whether this frame is finished too.
    fn child_done(&mut self) -> bool {
        match self {
            Frame::Seq(items, idx) => {
                *idx += 1;
                *idx >= items.len()
            }
            Frame::Arr { count, phase, .. } => {
                *count += 1;
                *phase = ContPhase::After;
                false
            }
            Frame::AnyObj { count, phase, .. } => {
                // After the key (phase already Colon) or the `: ` literal (already Value)
                // nothing changes; after a member value the object may close or continue.
                if *phase == ContPhase::Member {
                    *count += 1;
                    *phase = ContPhase::After;
                }
                false
            }
            _ => false,
        }
    }

    /// Whether the frame could end here (lazy frames: numbers, prefix-ambiguous choices).
    fn complete(&self) -> bool {
        match self {
            Frame::Num(t, int) => number_state(t, *int) == Some(true),
            Frame::Choice(options, typed) => {
                options.iter().any(|o| o.iter().copied().eq(typed.chars()))
            }
            _ => false,
        }
    }
}

/// A literal: `c` must be the next expected character.
fn step_lit(chars: &[char], pos: &mut usize, c: char) -> Step {
    if chars.get(*pos) == Some(&c) {
        *pos += 1;
        if *pos == chars.len() {
            Step::Done
        } else {
            Step::More
        }
    } else {
        Step::Reject
    }
}

/// A choice of literals: `c` must extend `typed` towards some option; a complete option that
/// `c` cannot extend hands `c` back to the parent.
fn step_choice(options: &[Vec<char>], typed: &mut String, c: char) -> Step {
    let complete = options.iter().any(|o| o.iter().copied().eq(typed.chars()));
    typed.push(c);
    let n = typed.chars().count();
    let alive: Vec<&Vec<char>> = options
        .iter()
        .filter(|o| o.len() >= n && o[..n].iter().copied().eq(typed.chars()))
        .collect();
    if alive.is_empty() {
        typed.pop();
        return if complete {
            Step::NotMine
        } else {
            Step::Reject
        };
    }
    if alive.len() == 1 && alive[0].len() == n {
        Step::Done
    } else {
        Step::More
    }
}

/// A string of at most `max` characters: the opening quote, characters and escapes (`\uXXXX`
/// included), the closing quote.
fn step_str(phase: &mut StrPhase, len: &mut usize, max: usize, c: char) -> Step {
    match *phase {
        StrPhase::Open => {
            if c == '"' {
                *phase = StrPhase::In;
                Step::More
            } else {
                Step::Reject
            }
        }
        StrPhase::In => match c {
            '"' => Step::Done,
            _ if *len >= max => Step::Reject,
            '\\' => {
                *phase = StrPhase::Esc;
                Step::More
            }
            c if (c as u32) < 0x20 => Step::Reject,
            _ => {
                *len += 1;
                Step::More
            }
        },
        StrPhase::Esc => match c {
            '"' | '\\' | '/' | 'b' | 'f' | 'n' | 'r' | 't' => {
                *len += 1;
                *phase = StrPhase::In;
                Step::More
            }
            'u' => {
                *phase = StrPhase::Uni(0);
                Step::More
            }
            _ => Step::Reject,
        },
        StrPhase::Uni(k) => {
            if !c.is_ascii_hexdigit() {
                return Step::Reject;
            }
            if k == 3 {
                *len += 1;
                *phase = StrPhase::In;
            } else {
                *phase = StrPhase::Uni(k + 1);
            }
            Step::More
        }
    }
}

/// A number (`int`: an integer) within its length cap; a complete number that `c` cannot
/// extend hands `c` back to the parent.
fn step_num(text: &mut String, int: bool, c: char) -> Step {
    let complete = number_state(text, int) == Some(true);
    let cap = if int {
        MAX_INTEGER_CHARS
    } else {
        MAX_NUMBER_CHARS
    };
    if text.len() < cap {
        text.push(c);
        if number_state(text, int).is_some() {
            return Step::More;
        }
        text.pop();
    }
    if complete {
        Step::NotMine
    } else {
        Step::Reject
    }
}

/// An array of `min..=max` items in the fixed layout (`[a, b]`): brackets and separators here,
/// each item in a pushed child frame.
fn step_arr(
    item: &Node,
    count: usize,
    min: usize,
    max: usize,
    phase: &mut ContPhase,
    c: char,
) -> Step {
    match *phase {
        ContPhase::Open => {
            if c == '[' {
                *phase = ContPhase::First;
                Step::More
            } else {
                Step::Reject
            }
        }
        ContPhase::First | ContPhase::After if c == ']' => {
            if count >= min {
                Step::Done
            } else {
                Step::Reject
            }
        }
        ContPhase::First | ContPhase::Next => {
            if count >= max {
                return Step::Reject;
            }
            *phase = ContPhase::Member;
            Step::Push(frame_for(item))
        }
        ContPhase::After => {
            if c == ',' && count < max {
                *phase = ContPhase::Space;
                Step::More
            } else {
                Step::Reject
            }
        }
        ContPhase::Space => {
            if c == ' ' {
                *phase = ContPhase::Next;
                Step::More
            } else {
                Step::Reject
            }
        }
        _ => Step::Reject,
    }
}

/// A free-form value nested at most `depth` deep: its first character picks the frame it
/// becomes.
fn step_any_val(depth: usize, c: char) -> Step {
    match c {
        '{' if depth > 0 => Step::Become(Frame::AnyObj {
            depth,
            count: 0,
            phase: ContPhase::Open,
        }),
        '[' if depth > 0 => Step::Become(Frame::Arr {
            item: Arc::new(Node::Any(depth - 1)),
            count: 0,
            min: 0,
            max: ANY_MAX_MEMBERS,
            phase: ContPhase::Open,
        }),
        '"' => Step::Become(frame_for(&Node::Str(DEFAULT_MAX_STRING_CHARS))),
        '-' | '0'..='9' => Step::Become(Frame::Num(String::new(), false)),
        't' | 'f' | 'n' => Step::Become(Frame::Choice(
            Arc::new(vec![
                "true".chars().collect(),
                "false".chars().collect(),
                "null".chars().collect(),
            ]),
            String::new(),
        )),
        _ => Step::Reject,
    }
}

/// A free-form object (`{"k": v, ...}`, at most [`ANY_MAX_MEMBERS`] members): braces,
/// separators and `: ` here, keys and values in pushed child frames.
fn step_any_obj(depth: usize, count: usize, phase: &mut ContPhase, c: char) -> Step {
    match *phase {
        ContPhase::Open => {
            if c == '{' {
                *phase = ContPhase::First;
                Step::More
            } else {
                Step::Reject
            }
        }
        ContPhase::First | ContPhase::After if c == '}' => Step::Done,
        ContPhase::First | ContPhase::Next => {
            if count >= ANY_MAX_MEMBERS {
                return Step::Reject;
            }
            *phase = ContPhase::Colon;
            Step::Push(frame_for(&Node::Str(64)))
        }
        ContPhase::Colon => {
            *phase = ContPhase::Value;
            Step::Push(Frame::Lit(": ".chars().collect::<Vec<_>>().into(), 0))
        }
        ContPhase::Value => {
            *phase = ContPhase::Member;
            Step::Push(Frame::AnyVal(depth.saturating_sub(1)))
        }
        ContPhase::After => {
            if c == ',' {
                *phase = ContPhase::Space;
                Step::More
            } else {
                Step::Reject
            }
        }
        ContPhase::Space => {
            if c == ' ' {
                *phase = ContPhase::Next;
                Step::More
            } else {
                Step::Reject
            }
        }
        ContPhase::Member => Step::Reject,
    }
}

/// The parse state of a partially generated document.
#[derive(Debug, Clone)]
pub struct JsonState {
    stack: Vec<Frame>,
}

impl JsonState {
    /// The start state for a compiled schema.
    pub fn new(node: &Node) -> Self {
        Self {
            stack: vec![frame_for(node)],
        }
    }

    /// Feeds one character; false when it cannot continue a valid document (state then undefined:
    /// feed clones).
    pub fn feed(&mut self, c: char) -> bool {
        loop {
            let Some(top) = self.stack.last_mut() else {
                return false;
            };
            match top.step(c) {
                Step::More => return true,
                Step::Done => {
                    self.pop_done();
                    return true;
                }
                Step::NotMine => {
                    self.pop_done();
                }
                Step::Push(f) => self.stack.push(f),
                Step::Become(f) => *top = f,
                Step::Reject => return false,
            }
        }
    }

    /// Pops the finished top frame and cascades completion to its parents.
    fn pop_done(&mut self) {
        self.stack.pop();
        while let Some(parent) = self.stack.last_mut() {
            if parent.child_done() {
                self.stack.pop();
            } else {
                break;
            }
        }
    }

    /// Feeds a whole string.
    pub fn feed_str(&mut self, s: &str) -> bool {
        s.chars().all(|c| self.feed(c))
    }

    /// Whether the document is complete (nothing more may follow).
    pub fn finished(&self) -> bool {
        self.stack.is_empty() || (self.stack.len() == 1 && self.stack[0].complete())
    }
}
